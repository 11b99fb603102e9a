"""fermijit's quantisers (ops/kquant_quantize.py) against llama.cpp's own, byte for byte, through
libggml-base's exported `quantize_row_<fmt>_ref` (ctypes). Run by hand where a libggml is built
(tests/llama_cpp_source.sh has its source):

    python -m tests.model.llama_quants LIBGGML_BASE_SO

Rows: N(0, 1) at several scales, uniform, Student-t (heavy tails), all of one sign, near zero,
quarter-integers (exact ties), 64 x 2048 each; and the rows tests/ops/test_kquant_quantize.py
measures its LLAMA_REL_RMS on, whose errors it prints."""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from fermijit.ops import kquant, kquant_quantize

SYMBOLS = {"q4_k": "q4_K", "q5_k": "q5_K", "q6_k": "q6_K", "q5_0": "q5_0", "q5_1": "q5_1"}


def llama_quantize(lib, name: str, x: np.ndarray) -> np.ndarray:
    fmt = kquant.FORMATS[name]
    fn = getattr(lib, f"quantize_row_{SYMBOLS[name]}_ref")
    out = np.zeros((x.shape[0], fmt.n_bytes(x.shape[1])), np.uint8)
    for r in range(x.shape[0]):
        row = np.ascontiguousarray(x[r], np.float32)
        fn(row.ctypes.data_as(ctypes.c_void_p), out[r].ctypes.data_as(ctypes.c_void_p),
           ctypes.c_int64(x.shape[1]))
    return out


def main(argv: list[str]) -> int:
    lib = ctypes.CDLL(argv[0])
    rng = np.random.default_rng(1)
    shape = (64, 2048)
    cases = {"normal 0.02": rng.standard_normal(shape) * 0.02,
             "uniform": rng.uniform(-1, 1, shape), "t(2) 1e-3": rng.standard_t(2, shape) * 1e-3,
             "positive": np.abs(rng.standard_normal(shape)),
             "negative x5": -np.abs(rng.standard_normal(shape)) * 5,
             "normal 1e-6": rng.standard_normal(shape) * 1e-6,
             "quarters": np.round(rng.standard_normal(shape) * 4) / 4}
    failed = 0
    for label, x in cases.items():
        x = x.astype(np.float32)
        for name, fmt in kquant.FORMATS.items():
            ours, theirs = kquant_quantize.quantize_cpu(fmt, x), llama_quantize(lib, name, x)
            ref = kquant_quantize.quantize(fmt, x)
            bad = int((kquant.block_view(fmt, ours) != kquant.block_view(fmt, theirs))
                      .any(axis=-1).sum()) + int((ref != ours).any())
            failed += bad
            print(f"{label:<12} {name}: {'same bytes' if not bad else f'{bad} blocks differ'}")
    x = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)
    for name, fmt in kquant.FORMATS.items():
        y = kquant.dequantize(fmt, llama_quantize(lib, name, x)).astype(np.float64)
        rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x.astype(np.float64) ** 2))
        print(f"llama.cpp {name} rel RMS error: {float(rel)!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
