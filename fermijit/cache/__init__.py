"""The snapshot prefix cache: a prompt resumes from the longest prefix of it whose state was saved.

    prefix_cache.py   in memory: a radix tree over token ids, KV rows on its edges, GDN states
                      (and logits) at its nodes, bounded by GreedyDual-Size eviction
    snapshot_dir.py   on disk (`--cache-dir`): one file per snapshot, shared between processes,
                      read as untrusted input (checked, optionally signed)

May import model/ (the state it copies, files, the model's fingerprint) and ops/ (the KV
cache's Q8_0 rows); never the engine or the prefill (the engine wraps its prefiller with it).
"""
