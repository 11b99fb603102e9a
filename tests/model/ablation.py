"""How far each part of a tiny model moves its logits: the float64 reference (model/reference.py)
with one part removed, against the whole model, over the oracle's prompt and 32 teacher-forced
decode steps, in the model tests' measure max|diff| / max|logits| (oracle.rel_error).

A sublayer is removed by zeroing its output matrix in every layer, a norm's weights by zeroing
them (the zero-centred norms then scale by 1, the GDN output norm's plain weight is set to 1),
RoPE by making it the identity. A test that cannot tell the model from one of these cannot tell
a model missing that part from the right one: tests/model/test_sensitivity.py holds every
ablation to 10x the tolerances the model is tested under. Print the table with
    .venv/bin/python -m tests.model.ablation
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import numpy as np

from fermijit.model import reference
from fermijit.model.config import load_config
from fermijit.model.reference import Reference
from fermijit.model.safetensors_io import Checkpoint
from fermijit.model.weights import AttentionWeights, GatedDeltaNetWeights, TextWeights, \
    load_text_weights
from tests.model import oracle


def _layers(change):
    return lambda w: dataclasses.replace(w, layers=tuple(change(layer) for layer in w.layers))


def _mixer(kind, field, value=np.zeros_like):
    def change(layer):
        if not isinstance(layer.mixer, kind):
            return layer
        m = layer.mixer
        return dataclasses.replace(layer, mixer=dataclasses.replace(
            m, **{field: value(getattr(m, field))}))
    return _layers(change)


def _mlp(field):
    return _layers(lambda layer: dataclasses.replace(layer, mlp=dataclasses.replace(
        layer.mlp, **{field: np.zeros_like(getattr(layer.mlp, field))})))


def _layer_norm(field):
    return _layers(lambda layer: dataclasses.replace(
        layer, **{field: np.zeros_like(getattr(layer, field))}))


ABLATIONS = {
    "attention output": _mixer(AttentionWeights, "o_proj"),
    "GDN output": _mixer(GatedDeltaNetWeights, "out_proj"),
    "routed experts": _mlp("experts_down"),
    "shared expert": _mlp("shared_down"),
    "RoPE": None,                                    # reference.rope made the identity
    "input norm weights": _layer_norm("input_layernorm"),
    "post-attention norm weights": _layer_norm("post_attention_layernorm"),
    "final norm weights": lambda w: dataclasses.replace(w, norm=np.zeros_like(w.norm)),
    "q norm weights": _mixer(AttentionWeights, "q_norm"),
    "k norm weights": _mixer(AttentionWeights, "k_norm"),
    "GDN norm weights": _mixer(GatedDeltaNetWeights, "norm", np.ones_like),
}


@contextlib.contextmanager
def rope_off():
    rope = reference.rope
    reference.rope = lambda x, *args: x
    try:
        yield
    finally:
        reference.rope = rope


def logits(cfg, weights: TextWeights, tokens) -> np.ndarray:
    """Prompt logits, then those after each of `tokens`, stacked [len(PROMPT) + len(tokens), V]."""
    model = Reference(cfg, weights)
    state = model.new_state()
    rows = [model.forward(oracle.PROMPT, state)]
    rows += [model.forward([t], state) for t in tokens]
    return np.concatenate(rows)


def table(checkpoint: Path, tokens) -> dict[str, np.ndarray]:
    """{ablation: per position, max|logits moved| / max|logits|} for the HF checkpoint at
    `checkpoint` (the max over positions is the figure of the table)."""
    cfg = load_config(checkpoint).text_config
    weights = load_text_weights(cfg, Checkpoint(checkpoint), np.float64)
    whole = logits(cfg, weights, tokens)
    moved = {}
    for name, ablate in ABLATIONS.items():
        if ablate is None:
            with rope_off():
                ablated = logits(cfg, weights, tokens)
        else:
            ablated = logits(cfg, ablate(weights), tokens)
        moved[name] = np.abs(ablated - whole).max(axis=1) / np.abs(whole).max()
    return moved


if __name__ == "__main__":
    import tempfile

    from tests.model import tiny

    for m in (tiny.HF_INIT, tiny.SENSITIVE):
        with tempfile.TemporaryDirectory() as tmp:
            moved = table(tiny.write_checkpoint(Path(tmp), model=m), oracle.golden(m).tokens)
        print(f"\n{m.name}: logits moved (max|diff| / max|logits|; over all positions, and "
              f"the median position)")
        for name, rel in moved.items():
            print(f"  {name:28s} {rel.max():.4f}  {np.median(rel):.4f}")
