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


def _same_blocks(a_dir, b_dir) -> None:
    a, b = SafetensorsFile(a_dir / convert.WEIGHTS), SafetensorsFile(b_dir / convert.WEIGHTS)
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        x, y = np.asarray(a.raw(name)), np.asarray(b.raw(name))
        if x.dtype == np.uint8 or name.endswith((".qs", ".d")):
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), name


def test_block_kinds_go_out_as_they_came_in(tmp_path):
    """A Q4_K_M GGUF as imported (Q4_K, Q5_0, Q5_1, Q6_K, Q8_0 blocks kept, the GDN out_proj in
    llama.cpp's tiled column order) exports to the same blocks: read back, bit for bit; and a
    Q4_0 model with a Q6_K head (`convert --lm-head q6_k`) likewise. These were tracebacks."""
    imported, back = tmp_path / "imported", tmp_path / "back"
    convert.convert(gguf_data.Q4_K_M, imported, show_progress=False)
    gguf_export.export(imported, tmp_path / "again.gguf")
    convert.convert(tmp_path / "again.gguf", back, show_progress=False)
    _same_blocks(imported, back)
    tokens = np.array([5, 17, 100, 3, 250, 9, 42], np.int32)
    logits = [m.prefill(tokens, m.new_state(tokens.size), all_logits=True)
              for _, m in (load_model(imported), load_model(back))]
    assert_close("logits of the model read back", logits[0], logits[1], atol=LOGITS_ATOL, rtol=0)
    hf = gguf_data.write_checkpoint(tmp_path / "wide-hf", gguf_data.WIDE)
    convert.convert(hf, tmp_path / "q6-head", lm_head="q6_k", show_progress=False)
    gguf_export.export(tmp_path / "q6-head", tmp_path / "q6-head.gguf")
    assert gguf_io.GgufFile(tmp_path / "q6-head.gguf").tensors["output.weight"].tensor_type.name \
        == "Q6_K"
    convert.convert(tmp_path / "q6-head.gguf", tmp_path / "q6-back", show_progress=False)
    _same_blocks(tmp_path / "q6-head", tmp_path / "q6-back")


def test_blocks_that_cannot_take_llama_cpps_column_order_are_one_line(tmp_path):
    """A Q4_K out_proj quantised in fermijit's grouped column order whose heads are not whole
    256-blocks (convert --quant q4_k_m of a checkpoint, synth's) cannot be reordered without
    requantising: refused, naming it, no file left."""
    from fermijit import FermijitError
    from fermijit.model import synth
    from tests.model.test_synth import SMALL_K

    synth.synth("qwen3.6-35b-a3b-reap128", tmp_path / "m", layers=4, show_progress=False,
                overrides=SMALL_K, mix="q4_k_m")
    with pytest.raises(FermijitError, match=r"out_proj in Q4_K: its heads of 64 columns are "
                                            r"not whole blocks"):
        gguf_export.export(tmp_path / "m", tmp_path / "m.gguf")
    assert list(tmp_path.glob("m.gguf*")) == []
