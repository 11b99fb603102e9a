"""JIT machinery: CPU feature detection and variant choice, SIMD intrinsics for Numba kernels,
and (for the GPU) PTX rendering, validation and loading.

    cpu.py        the ISA variant (chosen once), threads, `kernel`: njit with a source-keyed cache
    dispatch.py   Numba's dispatcher made lazier and its cache safe to share between processes
    simd.py       the SIMD vocabulary kernel bodies are written in, one emitter per idiom
    mathf.py      fp32 exp, sigmoid and silu that LLVM can vectorise
    omp.py        one OpenMP fork per launch; where the threads' time goes
    checks.py     argument checks before a kernel touches raw memory
    ptx.py        PTX templates declared, rendered and validated
    gpu.py        pycuda: loading rendered PTX, checked launches, device memory
    gpu_early.py  serve's GPU start from exec: the driver, the model file mapped and registered
    ptx_check.py  `kernels check`: every PTX variant through ptxas for sm_20, no GPU needed

May import only `fermijit` (FermijitError) and kernels_ptx (the templates): ops/ and model/
import this. Every CPU kernel's cache key holds a digest of this folder's sources (cpu.py), so an
edit here compiles the kernels again once.
"""
