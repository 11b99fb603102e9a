"""embedding.ptx: one token's row of the table per block row, widened to fp32."""

PARAMS = {
    "DTYPE": (str, ("f16", "f32")),  # the table's element type
}
