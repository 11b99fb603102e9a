"""flash_attention.ptx: causal GQA attention, flash style: 32 rows (GQA heads x positions) a block,
64-key tiles, online softmax, output rows in registers."""

PARAMS = {
    "HEAD_DIM": (int, (64, 128, 256)),  # D (the model's is 256); a multiple of 64
}
