"""The default model's pipeline (issue 4) in seconds: rst normalisation, the tokenizer, and a few
training steps of a tiny config on a tiny text, whose checkpoint model/weights.py and the
converter read back. The real run: `python -m training.train --data ... --minutes 8`.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from training import corpus

RST = """\
.. _json-intro:

:mod:`json` --- JSON encoder
============================

.. module:: json
   :synopsis: Encode and decode the JSON format.

.. index:: single: JSON

See :ref:`json-intro` and :func:`~json.dumps`; ``x`` is a `link <https://json.org>`_.

.. function:: dumps(obj, *, indent=None)

   Serialize *obj*, as :pep:`8` says. Example::

      >>> json.dumps([1])
      '[1]'

   .. versionadded:: 3.2
      The *indent* parameter.

.. note::
   A note.
"""

EXPECTED = """\
`json` --- JSON encoder

See `json` --- JSON encoder and `dumps()`; `x` is a link.

dumps(obj, *, indent=None)

   Serialize *obj*, as PEP 8 says. Example:

      >>> json.dumps([1])
      '[1]'

   New in version 3.2.
      The *indent* parameter.

Note:
   A note."""

# A few hundred words of plain English about Python, so a tiny model can learn something.
TEXT = """\
Python is a programming language that lets you work quickly and integrate systems effectively.
A list is a mutable sequence; a tuple is an immutable sequence. The len() function returns the
number of items in a container. Use a for loop to iterate over the items of a list. A dictionary
maps keys to values, and the keys must be hashable. Strings are immutable sequences of Unicode
code points. The open() function returns a file object; use it in a with statement so that the
file is closed when the block ends. Functions are defined with the def keyword and return a value
with return. Classes are defined with the class keyword; an instance is created by calling the
class. Modules are imported with the import statement. Exceptions are raised with raise and
handled with try and except. A generator function uses yield to produce a sequence of values.
"""


def test_normalise_renders_rst_as_sphinx_text():
    labels, firsts = corpus.section_titles({"library/json": RST})
    assert labels == {"json-intro": "`json` --- JSON encoder"}
    assert corpus.normalise(RST, labels, firsts) == EXPECTED


def test_heldout_rule_is_a_fixed_hash_of_the_document_id():
    ids = [f"library/m{i}" for i in range(400)]
    held = [d for d in ids if corpus.is_heldout(d)]
    assert held == [d for d in ids if corpus.is_heldout(d)]  # no state, no randomness
    assert 0.02 < len(held) / len(ids) < 0.09


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """train.txt / heldout.txt / tokenizer files as training/corpus.py writes them, tiny."""
    pytest.importorskip("tokenizers")
    data = tmp_path_factory.mktemp("corpus")
    sentences = TEXT.replace("\n", " ").split(". ")
    train_docs = [". ".join(sentences[i:] + sentences[:i]) for i in range(len(sentences))]
    (data / "train.txt").write_text(corpus.DOC_SEPARATOR.join(train_docs) + "\n")
    (data / "heldout.txt").write_text(TEXT)
    tokenizer = corpus.train_tokenizer(corpus.read_documents(data / "train.txt"), vocab_size=320)
    corpus.write_tokenizer(tokenizer, data, max_length=128)
    return data


def test_tokenizer_is_byte_level_and_deterministic(data_dir):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    assert tokenizer.token_to_id(corpus.EOT) == 0 and tokenizer.token_to_id(corpus.PAD) == 1
    text = "naïve code:\n    x = [1, 2]  # ok"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text  # any bytes round-trip, EOT skipped
    again = corpus.train_tokenizer(corpus.read_documents(data_dir / "train.txt"), vocab_size=320)
    assert again.to_str() == tokenizer.to_str()
    generation = json.loads((data_dir / "generation_config.json").read_text())
    assert {k: generation[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
    assert tokenizer.encode("x = 1").ids[0] == 0  # a prompt starts a document, as in training
    assert tokenizer.encode("x = 1", add_special_tokens=False).ids[0] != 0


def test_training_lowers_the_loss_and_saves_a_loadable_checkpoint(data_dir, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fermijit.model.config import load_config
    from fermijit.model.convert import convert, load_converted
    from fermijit.model.safetensors_io import Checkpoint
    from fermijit.model.weights import load_text_weights
    from training import train

    torch.set_num_threads(1)
    shape = dataclasses.replace(train.PRESETS["tiny"], context=32, batch=4, lr=1e-2)
    out = tmp_path / "ckpt"
    log = train.train(data_dir, out, shape, steps=30, minutes=None, evals=2,
                      device="cpu", quiet=True)

    curve = log["curve"]
    assert curve[0]["step"] == 1 and curve[-1]["step"] == 30
    assert curve[-1]["loss"] < curve[0]["loss"] - 1.0, curve
    assert log["evals"][-1]["loss"] < log["evals"][0]["loss"]
    assert json.loads((out / "train_log.json").read_text())["steps_done"] == 30

    cfg = load_config(out)  # rejects any field fermijit does not know
    text = cfg.text_config
    assert cfg.model_type == "qwen3_5_moe_text" and text.vocab_size == 320
    assert text.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert text.rope_parameters.rope_theta == 1e7
    weights = load_text_weights(text, Checkpoint(out))
    model = train.build_model(json.loads((out / "config.json").read_text()), seed=1)
    model.load_state_dict(_safetensors_state(out, torch))  # the HF names, nothing missing
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(weights.layers[0].mlp.experts_gate_up, gate_up)

    manifest = convert(out, tmp_path / "fermijit", show_progress=False)
    assert manifest.tensors["lm_head"].quant == "q8_0"
    _, converted, _ = load_converted(tmp_path / "fermijit")
    assert converted.layers[3].mixer.q_proj.shape == (2 * 2 * 32, 64)
    nbytes = (tmp_path / "fermijit" / "model.safetensors").stat().st_size
    assert 0 < nbytes - log["converted_nbytes_estimate"] < 64 << 10  # the estimate, plus headers


def _safetensors_state(directory, torch):
    from safetensors.torch import load_file

    state = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update({name: t.float() for name, t in load_file(str(path)).items()})
    return state


def test_real_routing_recipe_trains_the_published_routing_shape(data_dir, tmp_path):
    """`--routing real` (issue 36): the published config's experts, top-k and balancing
    coefficient, with transformers' pooled balancing loss (k, not 1, for a near-flat router),
    over a preset's other sizes; saved as a checkpoint the converter reads with 256 experts."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pathlib import Path

    from fermijit.model.config import load_config
    from fermijit.model.convert import convert
    from training import train

    published_path = Path(__file__).parents[1] / "model" / "data" / "qwen3.6-35b-a3b.config.json"
    published = json.loads(published_path.read_text())["text_config"]
    torch.set_num_threads(1)
    shape = dataclasses.replace(train.PRESETS["tiny"], context=32, batch=4)
    out = tmp_path / "ckpt"
    log = train.train(data_dir, out, shape, steps=2, minutes=None, evals=1,
                      device="cpu", routing=train.ROUTINGS["real"](), quiet=True)

    config = json.loads((out / "config.json").read_text())
    fields = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    assert {f: config[f] for f in fields} == {f: published[f] for f in fields}
    assert config["hidden_size"] == shape.hidden_size and config["moe_intermediate_size"] == 32
    assert log["args"]["routing"]["aux_form"] == "pooled"
    assert 8 <= log["curve"][0]["aux"] < 8.5  # E·Σ f·P pooled: k when flat (per-layer form: 1)
    text = load_config(out).text_config
    assert (text.num_experts, text.num_experts_per_tok) == (256, 8)
    state = _safetensors_state(out, torch)
    assert state["model.layers.0.mlp.gate.weight"].shape == (256, 64)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (256, 64, 64)
    manifest = convert(out, tmp_path / "fermijit", show_progress=False)
    assert manifest.tensors["layers.0.mlp.experts_gate_up"].shape[0] == 256


def test_mtp_head_learns_the_frozen_models_next_but_one_token(data_dir, tmp_path):
    """`--mtp-for` (issue 32 item 3): the head trains on the converted model's own states and
    distributions (the model frozen), and `add_mtp_head` stores it beside the model's tensors,
    which keep their bytes; the head then drafts, and speculative greedy decoding says what
    plain decoding says."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fermijit import engine
    from fermijit.model.convert import add_mtp_head, convert
    from fermijit.model.forward import load_model
    from fermijit.ops.sampling import Sampler
    from fermijit.speculative import Drafts
    from training import train as train_default

    torch.set_num_threads(1)
    shape = dataclasses.replace(train_default.PRESETS["tiny"], context=32, batch=4, lr=1e-2)
    train_default.train(data_dir, tmp_path / "ckpt", shape, steps=30, minutes=None, evals=1,
                        device="cpu", quiet=True)
    before = convert(tmp_path / "ckpt", tmp_path / "fj", show_progress=False)
    log = train_default.train_mtp(tmp_path / "fj", data_dir, tmp_path / "mtp", steps=30,
                                  minutes=None, batch=4, lr=3e-3, n_windows=16, quiet=True)
    curve = log["curve"]
    assert curve[-1]["step"] == 30 and curve[-1]["loss"] < curve[0]["loss"] - 1.0, curve
    assert log["windows"]["train"] == 16 and 0 < log["evals"][-1]["agree"] <= 1

    after = add_mtp_head(tmp_path / "fj", tmp_path / "mtp" / "head", tmp_path / "with")
    assert after.tensors["mtp.fc"].quant == "q4_0"
    for name, entry in before.tensors.items():
        assert after.tensors[name].checksum == entry.checksum, name
    _, model = load_model(tmp_path / "with")
    assert model.mtp is not None
    prompt = np.arange(2, 14, dtype=np.int32)

    def greedy(drafts):
        sampler = Sampler(model.vocab_size, temperature=0, top_k=0, top_p=1.0, seed=0)
        return engine.generate(model, prompt, sampler, 24, 64, frozenset(), lambda t: None,
                               drafts=drafts)

    plain, _ = greedy(None)
    spec, stats = greedy(Drafts())
    assert spec == plain and stats.speculative.drafted > 0
