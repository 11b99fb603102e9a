"""`python -m fermijit bench ...`: one module per benchmark, named for its subcommand (the click
commands stay in fermijit/cli.py), each printing a table and JSON; plus `profile`, the op-by-op
timer of `bench decode --profile`.

Owns: measurement only; no benchmark is imported by the runtime. May import everything below the
CLI: the engine, evaluate, speculative, server, prefill, cache, host, jit, and model/ and ops/.
"""
