"""q4_gemm.ptx: Q4_0 x fp32 GEMM, dense or per expert (gathered rows, fused SwiGLU, scatter-add)."""

PARAMS = {
    "MODE": (str, ("dense", "expert_gate_up", "expert_down")),
}
