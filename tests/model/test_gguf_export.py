"""GGUF out (issue 29 item 4: the same weights for llama.cpp): a fermijit model written as GGUF
lays its tensors out as llama.cpp's own converter does (names, shapes, the float tensors' values)
and reads back into fermijit bit for bit (quantised blocks) or within an ulp (norms, A_log)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fermijit.model import convert, gguf_export, gguf_io
from fermijit.model.forward import load_model
from fermijit.model.safetensors_io import SafetensorsFile
from tests.model import gguf_data
from tests.numerics import assert_close

pytest.importorskip("gguf")

# fermijit's float tensors against llama.cpp's F32 conversion of the same checkpoint: the norms'
# 1 + w and A_log's -exp each round once on the way out (an ulp of 1, of exp).
FLOAT_ATOL = 2.0 ** -23
FLOAT_RTOL = 2.0 ** -22
LOGITS_ATOL = 1e-5  # measured: equal to the last bit


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(fermijit conversion of the tiny checkpoint, its GGUF export, that GGUF converted back)."""
    root = tmp_path_factory.mktemp("gguf-export")
    hf = gguf_data.write_checkpoint(root / "tiny-hf")
    ours = root / "fermijit"
    convert.convert(hf, ours, show_progress=False)
    path = root / "tiny.gguf"
    written = gguf_export.export(ours, path)
    assert written["bytes"] == path.stat().st_size and written["tensors"] > 0
    back = root / "back"
    convert.convert(path, back, show_progress=False)
    return ours, path, back


def test_tensor_table_is_llama_cpps(exported):
    """Names and shapes as llama.cpp's converter writes them (its F32 file of the same checkpoint),
    and every tensor fermijit keeps in floats equal to llama.cpp's within the rounding above."""
    _, path, _ = exported
    mine, theirs = gguf_io.GgufFile(path), gguf_io.GgufFile(gguf_data.F32)
    assert set(mine.tensors) == set(theirs.tensors)
    for name, t in mine.tensors.items():
        assert [int(n) for n in t.shape] == [int(n) for n in theirs.tensors[name].shape], name
        if t.tensor_type.name == "F32":
            assert_close(name, np.asarray(theirs.tensors[name].data),
                         np.asarray(t.data), atol=FLOAT_ATOL, rtol=FLOAT_RTOL)
    for key in ("block_count", "embedding_length", "expert_count", "ssm.inner_size",
                "attention.recurrent_layers", "rope.dimension_sections", "rope.dimension_count"):
        assert mine.arch(key) == theirs.arch(key), key


def test_export_reads_back_bit_for_bit(exported):
    ours, _, back = exported
    a, b = SafetensorsFile(ours / convert.WEIGHTS), SafetensorsFile(back / convert.WEIGHTS)
    names = {n for n in a.tensors if not n.startswith("visual.")}
    assert names == set(b.tensors)
    for name in names:
        x, y = np.asarray(a.raw(name)), np.asarray(b.raw(name))
        if name.endswith((".qs", ".d")) or x.dtype != np.float32:
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), name
        else:
            assert_close(name, x, y, atol=FLOAT_ATOL, rtol=FLOAT_RTOL)
    (cfg_a, model_a), (cfg_b, model_b) = load_model(ours), load_model(back)
    # A GGUF carries no MTP layer unless its weights are there (fermijit converts none).
    assert dataclasses.replace(cfg_a.text_config, mtp_num_hidden_layers=0) == cfg_b.text_config
    tokens = np.array([5, 17, 100, 3, 250, 9, 42], np.int32)
    logits = [m.prefill(tokens, m.new_state(tokens.size), all_logits=True)
              for m in (model_a, model_b)]
    assert_close("logits of the model read back", logits[0], logits[1], atol=LOGITS_ATOL, rtol=0)
