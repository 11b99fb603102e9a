"""bias_act.ptx: the epilogue of the vision tower's fp32 GEMMs: bias, then residual or GELU."""

PARAMS = {
    "ACT": (str, ("none", "residual", "gelu_tanh", "gelu_erf")),
}
