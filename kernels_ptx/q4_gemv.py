"""q4_gemv.ptx: Q4_0 matrix x one fp32 vector (the prefill's LM head on its last position)."""

PARAMS = {}
