"""One module per operation: a numpy `reference` (the spec), a `cpu` kernel, and where it runs on
the GPU a `gpu` launcher, all with one signature (STYLE.md)."""
