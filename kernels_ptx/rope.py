"""rope.ptx: partial rotate-half RoPE with host-made cos/sin tables, one token per block."""

PARAMS = {}
