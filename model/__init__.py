"""Qwen3.6, the model: its config, the files it is read from and written to, and its forward.

    config.py          config.json as frozen dataclasses, unknown fields refused
    files.py           every file read from a model directory or from the user, checked
    manifest.py        fermijit.json: quantisation and checksums per tensor (upgrade_manifest.py
                       rewrites a format-1 one); data_hash.py: sha256 of a file for data caches
    safetensors_io.py  HF safetensors, both expert layouts
    gguf_*.py          GGUF: read, its tokenizer, converted once into a cache, exported
    convert.py         an HF checkpoint or a GGUF file -> the fermijit 4-bit format
    synth.py           random weights at the real shapes
    weights.py         per-layer weight dataclasses; state.py: KV caches and GDN states
    forward.py         prefill and decode, W4A8 through ops/ (block_moe.py: the MoE over GGUF
                       block formats); batch.py: the batched decode step; mtp.py: the MTP head;
                       token_bytes.py: the bytes a decode token reads
    reference.py       the float64 numpy forward, the spec
    vision*.py         the vision tower (numpy; vision_gpu.py its PTX); image.py: images read
                       and preprocessed; multimodal.py: prompts with images, MRoPE positions
    tokenizer.py       the tokenizer and chat template
    reap.py, prune.py  REAP expert pruning: calibration and the pruned model

May import ops/, fermijit.jit and fermijit.host (and `fermijit` for FermijitError). One
exception, the `prune` command's driver: prune.run and reap's default window reach up to
fermijit.prefill (calibration through the GPU prefill) and fermijit.evaluate (the text and the
window `eval` uses). How the embedded default model is trained: training/, outside the package.
"""
