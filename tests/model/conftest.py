"""Tiny checkpoints and transformers' outputs, made once per session and shared by the tests."""

from __future__ import annotations

import pytest

from tests.model import oracle, tiny

LAYOUTS = {"fused": dict(expert_layout="fused"),
           "split-3shards": dict(expert_layout="split", n_shards=3)}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(model, layout) -> an HF checkpoint directory of that tiny model, made once."""
    root = tmp_path_factory.mktemp("tiny-models")
    made = {}

    def get(model: tiny.Model, layout: str = "fused"):
        key = (model.name, layout)
        if key not in made:
            made[key] = tiny.write_checkpoint(root / f"{model.name}-{layout}", model=model,
                                              **LAYOUTS[layout])
        return made[key]

    return get


@pytest.fixture(scope="session")
def live_oracle(tiny_dir):
    """live_oracle(model, layout) -> transformers' Outputs, computed once; skips without torch."""
    if not oracle.has_transformers():
        pytest.skip("torch and transformers >= 5.24 are not importable: goldens stand in")
    made = {}

    def get(model: tiny.Model, layout: str = "fused") -> oracle.Outputs:
        key = (model.name, layout)
        if key not in made:
            made[key] = oracle.live(tiny_dir(model, layout))
        return made[key]

    return get
