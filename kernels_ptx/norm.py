"""norm.ptx: RMSNorm (1+w), gated RMSNorm and L2 norm of rows, one block of 256 per row."""

PARAMS = {
    "MODE": (str, ("rms", "gated", "l2")),
}
