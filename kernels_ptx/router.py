"""router.ptx: top-k of the expert logits and their softmax, one thread per token."""

PARAMS = {
    "TOP_K": (int, (1, 2, 3, 4, 5, 6, 7, 8)),  # experts per token (the model's is 8)
}
