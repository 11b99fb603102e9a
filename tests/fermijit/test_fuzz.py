"""Fuzzing the model files (issue 11, "Also"): hypothesis mutates the safetensors header,
fermijit.json and config.json of a valid tiny converted model, by JSON edits (a value replaced
by a hostile one, a key dropped) and by byte edits (flipped, cut, inserted), and the CLI must
answer exit 0 or exit 2 with one error line: never a traceback, a signal or a hang.

Each example runs `verify` (the loader's every check, then every checksum) in-process, and when
that passes, a 2-token `generate`. Bounded for CI: EXAMPLES examples, derandomised (the same
ones every run), no example database.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fermijit import cli  # noqa: E402
from fermijit.model import convert  # noqa: E402
from tests.model import tiny  # noqa: E402

EXAMPLES = 300
TARGETS = ("header", "fermijit.json", "config.json")

# What a hostile file may hold where a good one has a value.
HOSTILE = st.one_of(
    st.none(), st.booleans(),
    st.integers(-2, 2 ** 70), st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63, 2 ** 64 - 1, 10 ** 9]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "../model.safetensors", "/etc/passwd", "q5_k", "F8", "BF16", "q4_0",
                     "model.safetensors", "x" * 300]),
    st.text(max_size=8),
    st.lists(st.integers(-1, 2 ** 40), max_size=4),
    st.just([[[[[[[]]]]]]]), st.just({}), st.just({"a": 1}),
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    src = tiny.write_checkpoint(root / "src", "fused", "F32")
    convert.convert(src, root / "pristine", show_progress=False)
    d = root / "pristine"
    weights = (d / convert.WEIGHTS).read_bytes()
    (n,) = struct.unpack("<Q", weights[:8])
    return {"dir": root / "work", "pristine": d, "header": weights[8:8 + n].rstrip(b" "),
            "data": weights[8 + n:], "fermijit.json": (d / "fermijit.json").read_bytes(),
            "config.json": (d / "config.json").read_bytes()}


def paths(value, prefix=()):
    """Every (path, value) in a JSON value, depth first."""
    yield prefix, value
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        yield from paths(v, prefix + (k,))


@st.composite
def mutations(draw, files):
    target = draw(st.sampled_from(TARGETS))
    text = files[target]
    kind = draw(st.sampled_from(("replace", "drop", "bytes", "length")
                                if target == "header" else ("replace", "drop", "bytes")))
    if kind in ("replace", "drop"):
        raw = json.loads(text)
        where = draw(st.sampled_from(sorted(list(paths(raw)), key=repr)))[0]
        if not where:
            raw = draw(HOSTILE)
        else:
            parent = raw
            for k in where[:-1]:
                parent = parent[k]
            if kind == "drop" and isinstance(parent, dict):
                del parent[where[-1]]
            else:
                parent[where[-1]] = draw(HOSTILE)
        text = json.dumps(raw).encode()
    elif kind == "bytes":
        at = draw(st.integers(0, len(text)))
        edit = draw(st.sampled_from(("flip", "cut", "insert")))
        if edit == "flip" and at < len(text):
            text = text[:at] + bytes([text[at] ^ draw(st.integers(1, 255))]) + text[at + 1:]
        elif edit == "cut":
            text = text[:at]
        else:
            text = text[:at] + draw(st.binary(min_size=1, max_size=8)) + text[at:]
    length = None
    if kind == "length":
        length = draw(st.sampled_from((0, 1, len(text) - 1, len(text) + 1, 2 ** 63, 2 ** 64 - 1)))
    return target, text, length


def write(model, target, text, length) -> None:
    d = model["dir"]
    d.mkdir(exist_ok=True)
    for name in ("fermijit.json", "config.json"):
        (d / name).write_bytes(text if target == name else model[name])
    header = text if target == "header" else model["header"]
    n = len(header) if length is None else length
    (d / convert.WEIGHTS).write_bytes(struct.pack("<Q", n) + header + model["data"])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if not (d / name).exists():
            (d / name).write_bytes((model["pristine"] / name).read_bytes())


def run(*args) -> tuple[int, str]:
    """The CLI in-process: (exit code, stderr)."""
    out, err = io.TextIOWrapper(io.BytesIO()), io.StringIO()
    argv = sys.argv
    sys.argv = ["fermijit", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main()
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
    return code, err.getvalue()


def check(code, err, what):
    assert code in (0, 2), (what, code, err)
    assert "Traceback" not in err, (what, err)
    if code == 2:
        lines = err.splitlines()
        assert [x for x in lines if x.startswith("Error")] == lines[-1:], (what, err)


def test_fuzzed_model_files_are_exit_0_or_one_line(model):
    outcomes = {"verify ok": 0, "verify error": 0, "generate ok": 0, "generate error": 0}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations(model))
    def one(mutation):
        target, text, length = mutation
        write(model, target, text, length)
        code, err = run("verify", "--model", model["dir"])
        check(code, err, ("verify", mutation))
        outcomes["verify ok" if code == 0 else "verify error"] += 1
        if code == 0:
            code, err = run("generate", "--model", model["dir"], "--max-tokens", 2,
                            "--temperature", 0, "--threads", 1, "the cat")
            check(code, err, ("generate", mutation))
            outcomes["generate ok" if code == 0 else "generate error"] += 1

    one()
    print(f"fuzz: {EXAMPLES} examples: {outcomes}", file=sys.__stderr__)
    assert outcomes["verify error"] > EXAMPLES // 2 and outcomes["verify ok"] > 0
