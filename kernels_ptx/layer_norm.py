"""layer_norm.ptx: LayerNorm with bias over rows (the vision tower), one block of 256 per row."""

PARAMS = {}
