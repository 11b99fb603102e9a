"""Which device prefills a prompt, and the GPU prefill itself.

    hybrid.py         the prefiller chosen once per run (`--prefill cpu|gpu|auto`) and the GPU
                      memory plan; the CPU prefill it wraps is model/forward.py's
    gpu_prefill.py    the forward over a whole prompt on the GPU, dense weights resident
    gpu_layout.py     the GPU prefill's arrays and sizes, computed on the host (no GPU needed)
    gpu_state.py      the KV caches and GDN states sent to the GPU and handed back for decode
    expert_stream.py  the routed experts streamed from page-locked host memory, one layer ahead

May import model/, ops/, fermijit.jit and fermijit.host; never the engine, the cache, the server
or the benchmarks (they call in here).
"""
