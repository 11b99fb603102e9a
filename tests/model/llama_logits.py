"""llama.cpp's logits of a GGUF model for given token ids, through libllama (ctypes): the other
side of fermijit's NLL in tests/model/kquant_report.py (issue 34). Used by hand:

    python -m tests.model.llama_logits LIBLLAMA_SO MODEL.gguf 1 2 3 ...

The structs are llama.h's of the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist (the
one tests/model/llama_quantize.py calls); callbacks are declared as plain pointers (left NULL).
Each `logits(tokens)` call scores one window from an empty memory (positions 0..n-1, sequence
0): the recurrent state and the KV cache are cleared first, as fermijit's eval starts each
window from a fresh state.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

_P = ctypes.c_void_p


class ModelParams(ctypes.Structure):
    _fields_ = [("devices", _P), ("tensor_buft_overrides", _P), ("n_gpu_layers", ctypes.c_int32),
                ("split_mode", ctypes.c_int), ("load_mode", ctypes.c_int),
                ("lazy_mode", ctypes.c_int), ("main_gpu", ctypes.c_int32),
                ("tensor_split", _P), ("progress_callback", _P),
                ("progress_callback_user_data", _P), ("kv_overrides", _P),
                ("vocab_only", ctypes.c_bool), ("check_tensors", ctypes.c_bool),
                ("use_extra_bufts", ctypes.c_bool), ("no_host", ctypes.c_bool),
                ("no_alloc", ctypes.c_bool), ("load_mtp", ctypes.c_bool)]


class ContextParams(ctypes.Structure):
    _fields_ = [("n_ctx", ctypes.c_uint32), ("n_batch", ctypes.c_uint32),
                ("n_ubatch", ctypes.c_uint32), ("n_seq_max", ctypes.c_uint32),
                ("n_rs_seq", ctypes.c_uint32), ("n_outputs_max", ctypes.c_uint32),
                ("n_outputs_max_per_seq", ctypes.c_uint32), ("n_threads", ctypes.c_int32),
                ("n_threads_batch", ctypes.c_int32), ("ctx_type", ctypes.c_int),
                ("rope_scaling_type", ctypes.c_int), ("pooling_type", ctypes.c_int),
                ("attention_type", ctypes.c_int), ("flash_attn_type", ctypes.c_int),
                ("rope_freq_base", ctypes.c_float), ("rope_freq_scale", ctypes.c_float),
                ("yarn_ext_factor", ctypes.c_float), ("yarn_attn_factor", ctypes.c_float),
                ("yarn_beta_fast", ctypes.c_float), ("yarn_beta_slow", ctypes.c_float),
                ("yarn_orig_ctx", ctypes.c_uint32), ("defrag_thold", ctypes.c_float),
                ("cb_eval", _P), ("cb_eval_user_data", _P), ("type_k", ctypes.c_int),
                ("type_v", ctypes.c_int), ("abort_callback", _P), ("abort_callback_data", _P),
                ("embeddings", ctypes.c_bool), ("offload_kqv", ctypes.c_bool),
                ("no_perf", ctypes.c_bool), ("op_offload", ctypes.c_bool),
                ("swa_full", ctypes.c_bool), ("kv_unified", ctypes.c_bool),
                ("samplers", _P), ("n_samplers", ctypes.c_size_t), ("ctx_other", _P)]


class Batch(ctypes.Structure):
    _fields_ = [("n_tokens", ctypes.c_int32), ("token", ctypes.POINTER(ctypes.c_int32)),
                ("embd", ctypes.POINTER(ctypes.c_float)), ("pos", ctypes.POINTER(ctypes.c_int32)),
                ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
                ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))),
                ("logits", ctypes.POINTER(ctypes.c_int8))]


def _declare(lib) -> None:
    sigs = {
        "llama_backend_init": (None, []),
        "llama_model_default_params": (ModelParams, []),
        "llama_context_default_params": (ContextParams, []),
        "llama_model_load_from_file": (_P, [ctypes.c_char_p, ModelParams]),
        "llama_init_from_model": (_P, [_P, ContextParams]),
        "llama_model_get_vocab": (_P, [_P]),
        "llama_vocab_n_tokens": (ctypes.c_int32, [_P]),
        "llama_get_memory": (_P, [_P]),
        "llama_memory_clear": (None, [_P, ctypes.c_bool]),
        "llama_batch_init": (Batch, [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]),
        "llama_batch_free": (None, [Batch]),
        "llama_decode": (ctypes.c_int32, [_P, Batch]),
        "llama_get_logits": (ctypes.POINTER(ctypes.c_float), [_P]),
        "llama_free": (None, [_P]),
        "llama_model_free": (None, [_P]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


class LlamaModel:
    """A GGUF model in libllama, on the CPU, with a context of `n_ctx` tokens in one batch."""

    def __init__(self, libllama: str, gguf: str, n_ctx: int, n_threads: int = 1):
        self.lib = lib = ctypes.CDLL(libllama)
        _declare(lib)
        lib.llama_backend_init()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"libllama could not load {gguf}")
        cp = lib.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = n_threads
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"libllama could not make a context for {gguf}")
        self.n_ctx = n_ctx
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def logits(self, tokens) -> np.ndarray:
        """float32 [n, V]: the logits after each of `tokens` (n <= n_ctx), from an empty memory."""
        tokens = np.asarray(tokens, dtype=np.int32)
        n = tokens.size
        if not 0 < n <= self.n_ctx:
            raise ValueError(f"{n} tokens for a context of {self.n_ctx}")
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(t), i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, 1
            batch.n_tokens = n
            rc = lib.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            out = lib.llama_get_logits(self.ctx)
            return np.ctypeslib.as_array(out, shape=(n, self.n_vocab)).copy()
        finally:
            lib.llama_batch_free(batch)

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None


if __name__ == "__main__":
    toks = [int(t) for t in sys.argv[3:]]
    m = LlamaModel(sys.argv[1], sys.argv[2], max(len(toks), 8))
    print(m.logits(toks)[:, :8])
    m.close()
