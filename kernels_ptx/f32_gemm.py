"""f32_gemm.ptx: out = x . w^T in fp32 for the small dense products of prefill, with an epilogue."""

PARAMS = {
    "MODE": (str, ("plain", "sigmoid", "gates")),
}
