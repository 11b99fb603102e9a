"""Small fp32 products of the GPU prefill (kernels_ptx/f32_gemm.ptx): the weights that stay fp32
in the 4-bit model, read by every token of a prefill pass (MODEL.md §4, §6.3).

    plain    out [T, N] = x · wᵀ                          router logits (w [E, H])
    sigmoid  out [T, N] = σ(x · wᵀ)                       the shared expert's gate (w [1, H])
    gates    (g, beta) [T, Hv] from x · [w_b; w_a]ᵀ      ops.gated_delta's gates, fused

Letters: T tokens, N outputs, K inputs (x [T, K], w [N, K] fp32), Hv value heads. The CPU path
is ops/fp32_rows.py (model/forward.py), so only `reference` and `gpu` live here.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.ops import gated_delta

MODES = ("plain", "sigmoid", "gates")
TILE = 16  # outputs and tokens per block side (f32_gemm.ptx)


def reference(x, w, mode: str = "plain"):
    """x [T, K], w [N, K] -> [T, N] fp32 (float64 inside); mode "plain" or "sigmoid"."""
    y = x.astype(np.float64) @ w.astype(np.float64).T
    if mode == "sigmoid":
        y = np.exp(-np.logaddexp(0, -y))
    return y.astype(np.float32)


def gates_reference(x, w_ba, A_log, dt_bias):
    """x [T, K], w_ba [2Hv, K] (in_proj_b rows, then in_proj_a rows) -> (g, beta) [T, Hv]."""
    ba = x.astype(np.float64) @ w_ba.astype(np.float64).T
    hv = w_ba.shape[0] // 2
    g, beta = gated_delta.gates_reference(ba[:, hv:], ba[:, :hv], A_log, dt_bias)
    return g.astype(np.float32), beta.astype(np.float32)


def _launch(op, mode, x, w, outs, extra, n_cols_out):
    from fermijit.jit import gpu as g

    g.check_array(op, "x", x, np.float32, ndim=2)
    n_tokens, k = x.shape
    g.check_array(op, "w", w, np.float32, (None, k))
    n_cols = w.shape[0]
    if k == 0 or n_cols == 0:
        raise FermijitError(f"{op}: x {list(x.shape)} and w {list(w.shape)} must be non-empty")
    devs = [g.output(op, o, (n_tokens, n_cols_out)) for o in outs]
    if n_tokens:
        g.kernel("f32_gemm", MODE=mode)(
            (-(-n_cols // TILE), -(-n_tokens // TILE)), (TILE * TILE,),
            g.to_device(op, "x", x, np.float32), g.to_device(op, "w", w, np.float32),
            devs[0], devs[1] if len(devs) > 1 else None,
            *extra, n_tokens, n_cols, k, n_cols_out if mode == "gates" else 0)
    return devs


def gpu(x, w, mode: str = "plain", out=None):
    """`reference` on the GPU; arrays numpy or on the device (fermijit.jit.gpu)."""
    from fermijit.jit import gpu as g

    op = "f32_gemm"
    if mode not in ("plain", "sigmoid"):
        raise FermijitError(f"{op}: mode must be plain or sigmoid, got {mode!r}")
    on_device = g.is_device(x) or g.is_device(out)
    n_cols = getattr(w, "shape", (0,))[0]
    (y,) = _launch(op, mode, x, w, [out], (None, None), n_cols)
    return g.result(op, y, out, on_device)


def gates_gpu(x, w_ba, A_log, dt_bias, out=None):
    """`gates_reference` on the GPU; `out` a (g, beta) pair, both numpy or both on the device."""
    from fermijit.jit import gpu as g

    op = "f32_gemm gates"
    rows = getattr(w_ba, "shape", (0,))[0]
    if rows % 2 or rows == 0:
        raise FermijitError(f"{op}: w_ba must have 2 Hv rows, got shape {list(w_ba.shape)}")
    hv = rows // 2
    g.check_array(op, "A_log", A_log, np.float32, (hv,))
    g.check_array(op, "dt_bias", dt_bias, np.float32, (hv,))
    g_out, beta_out = (None, None) if out is None else out
    on_device = g.is_device(x) or g.is_device(g_out)
    beta, gate = _launch(op, "gates", x, w_ba, [beta_out, g_out],
                         (g.to_device(op, "A_log", A_log, np.float32),
                          g.to_device(op, "dt_bias", dt_bias, np.float32)), hv)
    return g.result(op, gate, g_out, on_device), g.result(op, beta, beta_out, on_device)
