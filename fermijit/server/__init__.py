"""`python -m fermijit serve`: an OpenAI-compatible HTTP server.

    protocol.py   requests parsed and checked into a `Job`; responses and OpenAI's error JSON
    scheduler.py  the thread that owns the model: admits jobs between steps (tokenise, prefill
                  through the snapshot prefix cache), decodes all active sequences in one batched
                  step (model/batch.py), samples, detokenises, holds back stop strings
    state_pool.py new sequences' GDN states, resident (page-locked with the GPU) and reused
    app.py        the Starlette app: routes, API key, body limit, server-sent events
    run.py        the CLI's entry: load the engine, warm the kernels, run uvicorn

The event loop never touches the model or the cache (neither is thread-safe): it hands jobs to
the scheduler through a bounded queue and receives events back, thread-safely.

May import the engine and speculative decoding (fermijit/), prefill/, jit/ and model/; never the
benchmarks or the CLI (`bench serve` and the CLI call in here).
"""
