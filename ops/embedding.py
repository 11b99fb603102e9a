"""Token embedding: gather rows of the table (MODEL.md §4: embeddings are not scaled).

    y[t] = table[ids[t]]

Dimensions: T tokens, V vocabulary (248320), H hidden (2048). The table is float16 or float32
[V, H] (the converter keeps it unquantised); the result is fp32 [T, H].
"""

from __future__ import annotations

import numpy as np
from numba import prange

from fermijit import FermijitError
from fermijit.jit.checks import check_array, output
from fermijit.jit.cpu import kernel

# Numba cannot read float16 elements (notes/cpu-kernels.md, pitfall 4): the CPU path reads the
# bits as uint16 and looks the value up, 65536 exact entries (256 KB, cache-resident).
_F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
# From this many output elements the row copies run on all threads (decode embeds one token).
PARALLEL_MIN_ELEMENTS = 1 << 15


def reference(ids, table, out=None):
    """ids [T] int32, table [V, H] float16/float32 -> y [T, H] fp32."""
    y = table[ids].astype(np.float32)
    if out is None:
        return y
    out[...] = y
    return out


def _gather_f32(ids, table, out):
    for t in prange(ids.shape[0]):
        out[t, :] = table[ids[t], :]


def _gather_f16(ids, bits, lut, out):
    for t in prange(ids.shape[0]):
        row = bits[ids[t]]
        for j in range(row.shape[0]):
            out[t, j] = lut[row[j]]


_f32_serial, _f32_parallel = kernel(_gather_f32), kernel(parallel=True, variant="par")(_gather_f32)
_f16_serial, _f16_parallel = kernel(_gather_f16), kernel(parallel=True, variant="par")(_gather_f16)


def _check(op, ids, table, check):
    """(T, V, H) after checking `table` with `check(op, name, a, dtype, shape)` and the ids
    (which must be on the host) against the vocabulary."""
    if getattr(table, "dtype", None) not in (np.float16, np.float32) or len(table.shape) != 2:
        raise FermijitError(f"{op}: table must be float16 or float32 [V, H], got "
                            f"{getattr(table, 'dtype', type(table).__name__)} "
                            f"{list(getattr(table, 'shape', []))}")
    check(op, "table", table, table.dtype, (None, None))
    check_array(op, "ids", ids, np.int32, (None,))
    vocab, hidden = table.shape
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise FermijitError(f"{op}: token ids must be in [0, {vocab}), got "
                            f"[{ids.min()}, {ids.max()}]")
    return ids.shape[0], vocab, hidden


def cpu(ids, table, out=None):
    """ids [T] int32, table [V, H] float16/float32 (or a GGUF block table, model/weights.py
    BlockTensor: its rows dequantised as llama.cpp does, ops/kquant.py) -> y [T, H] fp32."""
    op = "embedding"
    if hasattr(table, "blocks"):
        from fermijit.ops import kquant

        vocab, hidden = table.shape
        check_array(op, "ids", ids, np.int32, (None,))
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise FermijitError(f"{op}: token ids must be in [0, {vocab}), got "
                                f"[{ids.min()}, {ids.max()}]")
        y = output(op, out, (ids.shape[0], hidden))
        y[...] = kquant.dequantize(kquant.FORMATS[table.kind], table.blocks[ids])
        return y
    n_tokens, _, hidden = _check(op, ids, table, check_array)
    y = output(op, out, (n_tokens, hidden))
    is_parallel = y.size >= PARALLEL_MIN_ELEMENTS
    if table.dtype == np.float32:
        (_f32_parallel if is_parallel else _f32_serial)(ids, table, y)
    else:
        (_f16_parallel if is_parallel else _f16_serial)(ids, table.view(np.uint16), _F16_TO_F32, y)
    return y


# --- GPU ----------------------------------------------------------------------------------------

GPU_THREADS = 256  # kernels_ptx/embedding.ptx: one block row of 256 columns per token


def gpu(ids, table, out=None):
    """As `cpu`; arrays numpy or on the device (fermijit.jit.gpu). The ids are checked against
    the vocabulary on the host, so device ids are copied back first (T ints)."""
    from fermijit.jit import gpu as g

    op = "embedding"
    on_device = g.is_device(table) or g.is_device(out)
    host_ids = ids.get() if g.is_device(ids) else ids
    n_tokens, _, hidden = _check(op, host_ids, table, g.check_array)
    y = g.output(op, out, (n_tokens, hidden))
    if n_tokens:
        dtype = "f16" if table.dtype == np.float16 else "f32"
        g.kernel("embedding", DTYPE=dtype)(
            (-(-hidden // GPU_THREADS), n_tokens), (GPU_THREADS,),
            g.to_device(op, "ids", ids, np.int32), g.to_device(op, "table", table, table.dtype),
            y, hidden)
    return g.result(op, y, out, on_device)
