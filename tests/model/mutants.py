"""Planted bugs (issue 12): does the model test suite catch each?

    .venv/bin/python -m tests.model.mutants [-k EXPRESSION] [NAME ...]

runs the model-level tests (TESTS) once per mutant in a fresh pytest process with this module
as a plugin (`-p tests.model.mutants`, the mutant named in FERMIJIT_MUTANT), which monkeypatches
the code under test before any test runs, and prints whether the mutant was caught and by
which test first. Each kind of bug is planted in the engine alone and, where the float64
reference has the same part, in the engine and the reference alike (then only transformers, the
oracle, can tell). `-k` selects tests as pytest's does: `-k "sensitive or w4a8_oracle"` shows
what the SENSITIVE model's tests catch on their own. Without FERMIJIT_MUTANT the plugin does
nothing.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
import types

import numpy as np

# The quick ones first: with -x a caught mutant stops at its first failure.
TESTS = ["tests/model/test_config.py", "tests/model/test_forward.py", "tests/model/test_oracle.py",
         "tests/model/test_sensitivity.py", "tests/model/test_long_prompt.py",
         "tests/model/test_real_shapes.py"]


# --- the bugs -------------------------------------------------------------------------------

def _engine_drops(method):
    """forward.Model.<method> computes, then its output is dropped (the sublayer adds nothing)."""
    from fermijit.model import forward

    original = getattr(forward.Model, method)

    def dropped(self, *args):
        original(self, *args)
        ws = next(a for a in args if isinstance(a, forward.Workspace))
        ws.y[...] = 0                                             # the sublayer's output
    setattr(forward.Model, method, dropped)


def _reference_drops(name):
    from fermijit.model import reference

    original = getattr(reference, name)
    setattr(reference, name, lambda x, *args, **kw: 0 * original(x, *args, **kw))


def drop_attention_engine():
    _engine_drops("attention")


def drop_attention_everywhere():
    drop_attention_engine()
    _reference_drops("attention")


def drop_gdn_engine():
    _engine_drops("gated_deltanet")


def drop_gdn_everywhere():
    drop_gdn_engine()
    _reference_drops("gated_deltanet")


def drop_shared_expert_engine():
    """The shared expert's down projection zeroed as the engine takes its weights."""
    from fermijit.model import forward
    from fermijit.ops import moe

    original = forward._experts

    def without_shared(mlp):
        e = original(mlp)
        if isinstance(e, moe.MoeWeights):
            return moe.MoeWeights(e.gate_up_qs, e.gate_up_d, e.down_qs, e.down_d,
                                  e.shared_gate_up_qs, e.shared_gate_up_d, e.shared_down_qs,
                                  np.zeros_like(e.shared_down_d), e.shared_gate)
        return forward.DenseExperts(e.gate_up, e.down, e.shared_gate_up,
                                    np.zeros_like(e.shared_down), e.shared_gate)
    forward._experts = without_shared


def drop_shared_expert_everywhere():
    from fermijit.model import reference

    drop_shared_expert_engine()
    original = reference.moe

    def without_shared(x, w, top_k):
        return original(x, dataclasses.replace(w, shared_down=0 * reference.dense(
            w.shared_down)), top_k)
    reference.moe = without_shared


def rope_off_engine():
    from fermijit.model import forward

    def identity(x, positions, rotary_dim, theta, out=None):
        if out is not None and out is not x:
            out[...] = x
        return x if out is None else out
    forward.rope = types.SimpleNamespace(cpu=identity)


def rope_off_everywhere():
    from fermijit.model import reference

    rope_off_engine()
    reference.rope = lambda x, *args: x


def norm_plus_one_dropped_engine():
    """Zero-centred RMSNorm scaling by w instead of 1 + w (every such norm of the engine)."""
    from fermijit.model import forward
    from fermijit.ops import rmsnorm

    def scale_by_w(x, w, eps, out=None):
        return rmsnorm.cpu(x, np.asarray(w, np.float32) - np.float32(1), eps, out=out)
    forward.rmsnorm = types.SimpleNamespace(cpu=scale_by_w, gated_cpu=rmsnorm.gated_cpu)


def norm_plus_one_dropped_everywhere():
    from fermijit.model import reference

    norm_plus_one_dropped_engine()
    reference.rmsnorm = lambda x, w, eps: (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True)
                                                       + eps) * reference.dense(w))


def quantiser_truncates():
    """Activations quantised by truncation, not rounding, in the kernel and in ops.matvec's
    reference alike (the bug the issue's review planted)."""
    from fermijit.ops import matvec

    def truncating_kernel(x, xq, dx, xsum8, lanes, step_blocks):
        n_tok, k = x.shape
        nb = k // 32
        xb = x.reshape(n_tok, nb, 32)
        d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = np.trunc(xb * inv[..., None]).astype(np.int8)
        whole, reg = nb // step_blocks * step_blocks, 16 * lanes   # the kernel's layout
        b = np.arange(nb)
        w = b % step_blocks
        lo = np.where(b < whole, (b - w) * 32 + (w // lanes) * 2 * reg + (w % lanes) * 16, b * 32)
        hi = np.where(b < whole, lo + reg, lo + 16)
        j = np.arange(32)
        at = np.where(j < 16, lo[:, None] + j, hi[:, None] + j - 16)
        xq[:, at.ravel()] = q.reshape(n_tok, k)
        dx[...] = d
        xsum8[...] = 8 * q.astype(np.int32).sum(axis=-1)

    def truncating_reference(x):
        xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
        dx = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(dx != 0, np.float32(1) / dx, np.float32(0)).astype(np.float32)
        return np.trunc(xb * inv[..., None]).astype(np.int8), dx

    def truncating_rows(x, act):  # prefill's quantiser (ops/quantize_rows.py), same layout
        from fermijit.ops import gemm
        q, d = truncating_reference(x)
        for b, (lo, hi) in enumerate(gemm.x_offsets(act.vec.isa, q.shape[1])):
            act.xq[:, lo:lo + 16] = q[:, b, :16]
            act.xq[:, hi:hi + 16] = q[:, b, 16:]
        act.dx[...] = d
        act.xsum8[...] = 8 * q.astype(np.int32).sum(axis=-1)

    matvec._quantize_act_kernel = truncating_kernel
    matvec.quantize_act_reference = truncating_reference
    matvec.quantize_rows = truncating_rows


def layer_type_off_by_one():
    """Layer types derived from full_attention_interval one layer early: i % n, not (i+1) % n."""
    from fermijit.model import config

    original = config._parse_text

    def shifted(raw, where):
        cfg = original(raw, where)
        if "layer_types" in raw:
            return cfg
        n = cfg.full_attention_interval
        kinds = tuple(config.FULL_ATTENTION if i % n == 0 else config.LINEAR_ATTENTION
                      for i in range(cfg.num_hidden_layers))
        return config.dataclasses.replace(cfg, layer_types=kinds)
    config._parse_text = shifted


MUTANTS = {
    "attention dropped (engine)": drop_attention_engine,
    "attention dropped (engine and reference)": drop_attention_everywhere,
    "GDN dropped (engine)": drop_gdn_engine,
    "GDN dropped (engine and reference)": drop_gdn_everywhere,
    "shared expert dropped (engine)": drop_shared_expert_engine,
    "shared expert dropped (engine and reference)": drop_shared_expert_everywhere,
    "RoPE off (engine)": rope_off_engine,
    "RoPE off (engine and reference)": rope_off_everywhere,
    "norm +1 dropped (engine)": norm_plus_one_dropped_engine,
    "norm +1 dropped (engine and reference)": norm_plus_one_dropped_everywhere,
    "quantiser truncating (kernel and its reference)": quantiser_truncates,
    "layer type off by one (config)": layer_type_off_by_one,
}


# --- the pytest plugin ----------------------------------------------------------------------

def pytest_configure(config):
    name = os.environ.get("FERMIJIT_MUTANT")
    if name:
        MUTANTS[name]()


# --- the runner -----------------------------------------------------------------------------

def run(name: str, tests=TESTS, select: str | None = None) -> tuple[bool, str, float]:
    """(caught, the first failing test or pytest's summary, seconds)."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "tests.model.mutants",
                        "-p", "no:cacheprovider", *(["-k", select] if select else []),
                        *[t for t in tests if os.path.exists(t)]],
                       env={**os.environ, "FERMIJIT_MUTANT": name}, capture_output=True,
                       text=True)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", r.stdout, re.M)
    summary = failed[0] if failed else r.stdout.strip().splitlines()[-1]
    return r.returncode != 0, summary, time.monotonic() - t0


if __name__ == "__main__":
    args = sys.argv[1:]
    select = None
    if args[:1] == ["-k"]:
        select, args = args[1], args[2:]
    names = args or list(MUTANTS)
    unknown = set(names) - set(MUTANTS)
    if unknown:
        sys.exit(f"unknown mutants {sorted(unknown)}; known: {list(MUTANTS)}")
    print("| mutant | caught | first failing test |\n| --- | --- | --- |", flush=True)
    for n in names:
        caught, what, seconds = run(n, select=select)
        print(f"| {n} | {'yes' if caught else 'NO'} | {what} ({seconds:.0f} s) |", flush=True)
