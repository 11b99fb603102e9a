"""The host's memory and threads as the kernels need them, below model/ and ops/.

    numa.py   NUMA placement of the memory-mapped weights (`--numa`)
    blas.py   numpy's BLAS at one thread while the Numba kernels run

May import only `fermijit` (FermijitError) and the standard library: model/ imports this.
"""
