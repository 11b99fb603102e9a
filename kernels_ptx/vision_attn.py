"""vision_attn.ptx: the vision tower's attention around two fp32 GEMMs: heads split with the 2-D
rotary, the softmax of score rows, and the heads merged back."""

PARAMS = {}
