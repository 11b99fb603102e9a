"""JIT machinery: CPU feature detection and variant choice, SIMD intrinsics for Numba kernels,
and (for the GPU) PTX rendering, validation and loading."""
