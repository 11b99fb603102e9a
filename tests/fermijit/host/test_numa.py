"""--numa and the default thread count: the policy reads back through get_mempolicy on whatever
topology this machine has; threads default to the physical cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from fermijit.host import numa
from fermijit.jit import cpu

pytestmark = pytest.mark.skipif(numa._syscall() is None, reason="no NUMA system calls here")

# Each policy in a fresh interpreter: the task policy would outlive the test otherwise.
PROBE = """
import json, sys
from fermijit import engine
from fermijit.host import numa
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


# A faked topology: two nodes of four cores, each core two SMT siblings (CPU c and c + 8).
FAKE_CORES = [[c, c + 8] for c in range(8)]
FAKE_NODE_OF = {c: (c % 8) // 4 for c in range(16)}


def test_bound_threads_sit_on_their_cores_nodes():
    assert numa.team_nodes(8, FAKE_CORES, FAKE_NODE_OF) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert numa.team_nodes(3, FAKE_CORES, FAKE_NODE_OF) == [0, 0, 0]
    assert numa.team_nodes(10, FAKE_CORES, FAKE_NODE_OF)[8:] == [0, 0]  # past the cores: wrap


def test_row_ranges_give_each_thread_the_whole_pages_of_its_rows():
    page, row = 4096, 1152  # K = 2048 Q4_0 rows: 1152 bytes, rows cross page boundaries
    nodes = numa.team_nodes(8, FAKE_CORES, FAKE_NODE_OF)
    address, n_rows = 1 << 30, 4096
    ranges = numa.row_ranges(address, n_rows, row, nodes, page)
    assert [r[2] for r in ranges] == [0, 1]  # threads 0-3 merged on node 0, 4-7 on node 1
    for start, length, node in ranges:
        assert start % page == 0 and length % page == 0
    half = address + n_rows // 2 * row  # thread 4's first row
    assert ranges[0][0] == address and ranges[0][0] + ranges[0][1] <= half
    assert ranges[1][0] >= half and half + page > ranges[1][0]
    end = address + n_rows * row
    assert end - page < ranges[1][0] + ranges[1][1] <= end
    # Every row of thread t lies in its node's range but for the pages a boundary cuts.
    for t, node in enumerate(nodes):
        lo = address + t * n_rows // 8 * row
        hi = address + (t + 1) * n_rows // 8 * row
        start, length, _ = ranges[node]
        assert start <= -(-lo // page) * page and hi // page * page <= start + length
    assert numa.row_ranges(address, 3, row, nodes, page) == []  # no whole page for anyone


def test_rows_placement_takes_effect_on_this_machines_node():
    """The mbind path on one node: every thread's pages preferred on node 0."""
    node = numa.online_nodes()[0]
    a = np.zeros((4096, 1152), np.uint8)
    placed = numa.place_rows([a], [node] * 4)
    ranges = numa.row_ranges(a.ctypes.data, 4096, 1152, [node] * 4)
    assert placed == sum(r[1] for r in ranges) > 0
    assert numa.policy_of(ranges[0][0] + 100) == (numa.MPOL_PREFERRED, [node])


ROWS = """
import json
from fermijit import engine
from fermijit.host import numa
from fermijit.model.forward import load_model
numa.select("rows")
_, model = load_model(engine.DEFAULT_MODEL)
head = model.lm_head
head = head.qs if hasattr(head, "qs") else head
expert = model.layers[0].experts.gate_up_qs
print(json.dumps({"head": numa.policy_of(head.ctypes.data + head.nbytes // 4),
                  "expert": numa.policy_of(expert.ctypes.data), "nodes": numa.online_nodes()}))
"""


def test_numa_rows_places_the_dense_rows_and_interleaves_the_experts():
    r = subprocess.run([sys.executable, "-c", ROWS], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["expert"] == [numa.MPOL_INTERLEAVE, got["nodes"]]
    assert got["head"][0] == numa.MPOL_PREFERRED and len(got["head"][1]) == 1
