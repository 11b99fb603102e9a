"""How the embedded default model (fermijit/default_model) is made; not installed, run from the
repository's root, and needs torch and transformers (`pip install -e '.[oracle]'`).

    corpus.py   the corpus (the Python 3.11 documentation, as text) and the byte-level BPE
                tokenizer: `python -m training.corpus build/default_corpus`
    train.py    trains the Qwen3.6-architecture model on it and writes an HF checkpoint:
                `python -m training.train --data build/default_corpus --out build/default-hf`,
                then `python -m fermijit convert build/default-hf fermijit/default_model`

May import fermijit's runtime (model/, ops/); nothing in fermijit imports this.
"""
