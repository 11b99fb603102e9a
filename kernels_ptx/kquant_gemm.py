"""kquant_gemm.ptx: K-quant (GGUF blocks as imported) x fp32 GEMM, q4_gemm.ptx's modes."""

PARAMS = {
    "MODE": (str, ("dense", "expert_gate_up", "expert_down")),
    "FORMAT": (str, ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q8_0")),
}
