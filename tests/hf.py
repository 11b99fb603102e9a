"""The one gate of the live transformers oracle: torch, and a transformers release whose internals
the tests call as they were validated (5.17, say, changed the rope and gated-delta functions'
signatures, and those tests then failed on arguments, not numerics)."""

import pytest

MIN_TRANSFORMERS = "5.24"


def available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        return False
    from packaging.version import Version
    return Version(transformers.__version__) >= Version(MIN_TRANSFORMERS)


def qwen_modeling():
    """transformers' Qwen3.5-MoE modeling module, or a skip saying why not."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)
    return pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
