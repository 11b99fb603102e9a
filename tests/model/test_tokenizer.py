"""Tokenizer, chat template, stop ids and streaming detokenisation (model/tokenizer.py), on the
byte-level BPE that tests/model/tiny.py trains."""

from __future__ import annotations

import json

import pytest

from fermijit import FermijitError
from fermijit.model.tokenizer import INCOMPLETE, Tokenizer
from tests.model import tiny

TEXT = "héllo 日本 🙂 the cat sat"  # 2-, 3- and 4-byte characters: byte tokens, unmerged


@pytest.fixture
def model_dir(tmp_path):
    tiny.write_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    return tmp_path


def test_round_trip_and_specials(model_dir):
    tok = Tokenizer(model_dir)
    ids = tok.encode(TEXT)
    assert ids.dtype.name == "int32" and tok.decode(ids) == TEXT
    assert tok.vocab_size == tiny.TOKENIZER_VOCAB
    assert list(tok.encode("<|im_start|>user")[:1]) == [tiny.SPECIAL_TOKENS.index("<|im_start|>")]
    assert tok.decode([4, 305]) == ""  # a special token, and an id of the model's padding


def test_stop_ids(model_dir):
    assert Tokenizer(model_dir, config_eos=2).eos_ids == {2, 3}  # generation_config.json first
    (model_dir / "generation_config.json").unlink()
    assert Tokenizer(model_dir, config_eos=2).eos_ids == {2}     # else config.json's
    assert Tokenizer(model_dir, config_eos=(2, 7)).eos_ids == {2, 7}
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(FermijitError, match="eos_token_id must be an int or a list of ints"):
        Tokenizer(model_dir)


def test_chat_template(model_dir):
    tok = Tokenizer(model_dir)
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 4 and 3 in ids  # <|im_start|>, <|im_end|> matched as special tokens


def test_chat_template_sources_and_errors(model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    # Named templates (a list), as some tokenizer_config.json files have.
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(model_dir).render_chat([{"role": "user", "content": "a"}]) == "a!"
    # chat_template.jinja, where newer exports keep it.
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(FermijitError, match="no chat template"):
        Tokenizer(model_dir).render_chat([{"role": "user", "content": "a"}])
    (model_dir / "chat_template.jinja").write_text(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ messages | tojson }}")
    tok = Tokenizer(model_dir)
    assert tok.render_chat([{"role": "user", "content": "é"}]) == \
        '[{"role": "user", "content": "é"}]'
    with pytest.raises(FermijitError, match="chat template: one message only"):
        tok.render_chat([{"role": "user", "content": "a"}] * 2)


@pytest.mark.parametrize("template, message", [
    ("{{ 1/0 }}", "chat template: ZeroDivisionError: division by zero"),
    ("{{ messages.x.y }}", "chat template:"),
    ("{{ 'a' * 2000000000 }}", "a repetition past the output limit"),
    ("{{ 'a'.center(2000000000) }}", "a count or width of 2000000000"),
    ("{{ 'x'|center(1000000000) }}", "a count or width of 1000000000"),
    ("{{ 'x\ny'|indent(1000000000) }}", "a count or width of 1000000000"),
    ("{{ '%1000000000s' % 'x' }}", "a count or width of 1000000000"),
    ("{{ '%*s' % (1000000000, 'x') }}", "a count or width of 1000000000"),
    ("{{ '%1000000000s'|format('x') }}", "a count or width of 1000000000"),
    ("{{ messages|tojson(indent=1000000000) }}", "a count or width of 1000000000"),
    ("{% set s = 'a' * 4000000 %}{{ s.replace('a', s) }}", "a replacement past the output"),
    ("{% set s = 'a' * 4000000 %}{{ s|replace('a', s) }}", "a replacement past the output"),
    ("{{ 2 ** 100000000 }}", "an exponent of 100000000"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output past 4 MiB"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "rendering took more than 2 s"),
    ("{% set ns = namespace(x='a') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}"
     "{% endfor %}{{ ns.x }}", "a concatenation past the output limit"),
])
@pytest.mark.parametrize("thread", ["main", "other"])
def test_hostile_chat_template_is_one_line(model_dir, template, message, thread):
    """Issue 11 cases 6 and 11: any Python error, and bounded time, output and memory, on the
    main thread (the CLI's, with an address-space cap) and on another (the server's request
    handlers, without: the sandbox's own bounds)."""
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "chat_template": template}))
    tok, raised = Tokenizer(model_dir), []

    def render():
        with pytest.raises(FermijitError, match=message) as e:
            tok.render_chat([{"role": "user", "content": "a"}])
        raised.append(e.value)

    if thread == "main":
        render()
    else:
        import threading

        rendering = threading.Thread(target=render)
        rendering.start()
        rendering.join()
    assert len(raised) == 1 and "\n" not in str(raised[0])


def test_a_bounded_template_renders_as_jinja2_does(model_dir):
    """The bounds leave ordinary templates alone: `~`, `%`, |format, |replace, .replace,
    |center, |indent as jinja2 renders them."""
    template = ("{{ 'a' ~ 'b' ~ 3 }}|{{ '%05d'|format(7) }}|{{ '%s-%s' % ('x', 'y') }}|"
                "{{ 'abc'|replace('b', 'X') }}|{{ 'abcb'.replace('b', 'Y', 1) }}|"
                "{{ 'x'|center(5) }}|{{ 'p\nq'|indent(2) }}|{{ messages[0].content ~ '!' }}")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "chat_template": template}))
    assert Tokenizer(model_dir).render_chat([{"role": "user", "content": "a"}]) == \
        "ab3|00007|x-y|aXc|aYcb|  x  |p\n  q|a!"


def test_missing_or_bad_files(tmp_path):
    with pytest.raises(FermijitError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{")
    with pytest.raises(FermijitError, match="not a readable tokenizer"):
        Tokenizer(tmp_path)


def test_stream_waits_for_whole_characters(model_dir):
    tok = Tokenizer(model_dir)
    stream = tok.stream()
    pieces = [stream.push(t) for t in tok.encode(TEXT)]
    pieces.append(stream.flush())
    assert "".join(pieces) == TEXT
    assert not any(INCOMPLETE in p for p in pieces)
    assert pieces.count("") >= 6, pieces  # the cut characters held back: 1 + 2 + 2 + 3 tokens


def test_stream_emits_invalid_bytes_once_they_are_final(model_dir):
    tok = Tokenizer(model_dir)
    first_byte_of_ri = int(tok.encode("日")[0])          # a lead byte without its continuation
    stream = tok.stream()
    assert stream.push(first_byte_of_ri) == ""
    assert stream.push(int(tok.encode("a")[0])) == INCOMPLETE + "a"
    assert stream.push(first_byte_of_ri) == ""
    assert stream.flush() == INCOMPLETE                  # the end: what is left, as it decodes
    assert stream.push(4) == "" and stream.flush() == ""  # special tokens are not text
