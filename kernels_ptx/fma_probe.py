"""fma_probe.ptx: independent fma chains per thread, the fp32 ceiling `bench gpu` divides by."""

PARAMS = {
    "CHAINS": (int, (8, 16)),  # independent chains per thread
    "UNROLL": (int, (16,)),  # steps of every chain per loop iteration
}
