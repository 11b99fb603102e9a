"""gdn_chunk.ptx: Gated DeltaNet chunked prefill (UT/WY, chunk 64): prep per chunk, then a scan."""

PARAMS = {}
