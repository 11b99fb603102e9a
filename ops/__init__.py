"""One module per operation: a numpy `reference` (the spec), a `cpu` kernel, and where it runs on
the GPU a `gpu` launcher, all with one signature (STYLE.md).

May import only fermijit.jit (and `fermijit` for FermijitError), and the PTX templates through
it; model/ and fermijit/prefill/ compose these. Every kernel's cache key holds a digest of this
folder's sources: an edit to any op compiles the ops' kernels again once.
"""
