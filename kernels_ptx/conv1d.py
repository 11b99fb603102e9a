"""conv1d.ptx: causal depthwise conv1d + SiLU over a whole sequence, then the state update."""

PARAMS = {
    "TAPS": (int, (2, 3, 4)),  # kernel width K (the model's is 4)
}
