"""attention.ptx: causal GQA attention, online softmax over 16-key tiles, sigmoid output gate."""

PARAMS = {
    "HEAD_DIM": (int, (32, 64, 128, 256)),  # D (the model's is 256); must divide 256
}
