"""--numa and the default thread count: the policy reads back through get_mempolicy on whatever
topology this machine has; threads default to the physical cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest

from fermijit import numa
from fermijit.jit import cpu

pytestmark = pytest.mark.skipif(numa._syscall() is None, reason="no NUMA system calls here")

# Each policy in a fresh interpreter: the task policy would outlive the test otherwise.
PROBE = """
import json, sys
from fermijit import engine, numa
from fermijit.model import convert
numa.select(sys.argv[1])
_, w, _ = convert.load_converted(engine.DEFAULT_MODEL)
address = w.layers[0].mlp.experts_gate_up.qs.ctypes.data
print(json.dumps({"mapping": numa.policy_of(address), "task": numa.policy_of(),
                  "nodes": numa.online_nodes()}))
"""


@pytest.mark.parametrize("policy, mode", [("interleave", numa.MPOL_INTERLEAVE),
                                          ("local", numa.MPOL_LOCAL), ("off", numa.MPOL_DEFAULT)])
def test_policy_takes_effect(policy, mode):
    r = subprocess.run([sys.executable, "-c", PROBE, policy], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    nodes = got["nodes"] if policy == "interleave" else []
    assert got["mapping"] == [mode, nodes]
    assert got["task"] == [mode, nodes]


def test_default_is_interleave_only_on_several_nodes():
    assert numa.default_policy() == ("interleave" if len(numa.online_nodes()) > 1 else "off")


def test_bad_policy_is_a_one_line_error():
    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "--numa", "spread", "x"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_threads_default_to_physical_cores():
    """Counted here from core_id and package id, not the sibling lists cpu.py reads."""
    root = Path("/sys/devices/system/cpu")
    cores = {((root / f"cpu{n}/topology/physical_package_id").read_text(),
              (root / f"cpu{n}/topology/core_id").read_text()) for n in os.sched_getaffinity(0)}
    assert cpu.physical_cores() == len(cores)
    code = "from fermijit.jit import cpu; print(cpu.configure_threads(None))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert int(r.stdout) == min(len(cores), numba.config.NUMBA_NUM_THREADS)
