"""llama.cpp's quantizer, `llama_model_quantize` of libllama, called through ctypes: what its
`llama-quantize IN OUT TYPE` does (tools/quantize: the default parameters, the ftype set), and
what llama-cpp-python's `llama_model_quantize` binding calls. Used to make test data by hand:

    python -m tests.model.llama_quantize LIBLLAMA_SO IN.gguf OUT.gguf Q4_0|Q8_0|Q4_K_M

The struct is llama.h's `llama_model_quantize_params` of the llama.cpp vendored in the
llama-cpp-python 0.3.36 sdist.
"""

from __future__ import annotations

import ctypes
import sys

FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}  # llama.h enum llama_ftype


class QuantizeParams(ctypes.Structure):
    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int),
                ("output_tensor_type", ctypes.c_int), ("token_embedding_type", ctypes.c_int),
                ("allow_requantize", ctypes.c_bool), ("quantize_output_tensor", ctypes.c_bool),
                ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
                ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool),
                ("imatrix", ctypes.c_void_p), ("kv_overrides", ctypes.c_void_p),
                ("tt_overrides", ctypes.c_void_p), ("prune_layers", ctypes.c_void_p),
                ("max_buf_size", ctypes.c_size_t)]


def quantize(libllama: str, src: str, dst: str, kind: str, n_threads: int = 1) -> None:
    lib = ctypes.CDLL(libllama)
    lib.llama_model_quantize_default_params.restype = QuantizeParams
    lib.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.POINTER(QuantizeParams)]
    lib.llama_model_quantize.restype = ctypes.c_uint32
    lib.llama_backend_init()
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.nthread = FTYPES[kind], n_threads
    if lib.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {dst} {kind} failed")


if __name__ == "__main__":
    quantize(*sys.argv[1:5])
