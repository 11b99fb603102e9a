"""model/files.py: the one JSON reader, path rule and text reader, and the SIGBUS line (issue 11
cases 1, 3, 6, 12, 13 and "Also")."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import pytest

from fermijit import FermijitError
from fermijit.model import files


@pytest.mark.parametrize("text, message", [
    ('{"a": NaN}', "NaN is not a number JSON allows"),
    ('{"a": Infinity}', "Infinity is not a number JSON allows"),
    ('{"a": -Infinity}', "-Infinity is not a number JSON allows"),
    ('{"a": 1e400}', "1e400 overflows a float"),
    ('{"a": 1, "a": 2}', "the key 'a' appears twice"),
    ('{"a": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"a": ' + "[" * 40 + "]" * 40 + "}", "nested more than 32 deep"),
    ("{nope", "not valid JSON (Expecting property name"),
    (b'{"a": "\xff"}', "not UTF-8"),
])
def test_hostile_json_is_one_line(text, message):
    with pytest.raises(FermijitError, match=message.replace("(", r"\(")) as e:
        files.parse_json(text, "x.json")
    assert str(e.value).startswith("x.json: ") and "\n" not in str(e.value)


def test_good_json_reads_as_json():
    assert files.parse_json('{"a": [1, 2.5, -3e2, null, true], "b": {"c": "d"}}', "x") == \
        {"a": [1, 2.5, -300.0, None, True], "b": {"c": "d"}}


def test_read_json_wants_a_small_regular_object(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("[1]")
    with pytest.raises(FermijitError, match="expected a JSON object"):
        files.read_json(path)
    path.write_text('{"a": "' + "x" * 2000 + '"}')
    with pytest.raises(FermijitError, match="larger than 0 MiB"):
        files.read_json(path, limit=1000)
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(FermijitError, match="not a regular file"):
        files.read_json(tmp_path / "fifo.json")
    with pytest.raises(FermijitError, match="not a regular file"):
        files.read_json("/dev/zero")


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "..", ".", "", "a\\b", None, 3])
def test_member_takes_bare_file_names_only(tmp_path, name):
    with pytest.raises(FermijitError, match="is not a bare file name"):
        files.member(tmp_path, name, "fermijit.json: weights")


def test_member_joins_a_bare_name(tmp_path):
    assert files.member(tmp_path, "model.safetensors", "x") == tmp_path / "model.safetensors"


def test_text_is_capped_and_utf8(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_TEXT_BYTES", 1000)
    with pytest.raises(FermijitError, match="larger than"):
        files.read_text("/dev/zero", "--text /dev/zero")
    with pytest.raises(FermijitError, match="standard input: larger than"):
        files.read_text(io.BytesIO(b"a" * 1001), "standard input")
    with pytest.raises(FermijitError, match="not UTF-8 text"):
        files.read_text(io.BytesIO(b"\xff\xfe"), "standard input")
    assert files.read_text(io.BytesIO("é".encode()), "standard input") == "é"
    with pytest.raises(FermijitError, match="the prompt: not valid UTF-8"):
        files.check_text("a\udcff", "the prompt")  # argv bytes that were not UTF-8


def test_sigbus_is_one_line_naming_the_file(tmp_path):
    """A mapped file truncated under the reader: one line naming it, exit 2, no core dump."""
    path = tmp_path / "weights.bin"
    code = textwrap.dedent(f"""
        import os, numpy as np
        from fermijit.model.files import guard_mapping
        path = {str(path)!r}
        open(path, "wb").write(b"x" * (1 << 20))
        m = np.memmap(path, dtype=np.uint8, mode="r")
        guard_mapping(path)
        os.truncate(path, 0)
        print(int(m.sum()))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if not (sys.platform.startswith("linux") and os.uname().machine == "x86_64"):
        pytest.skip("the SIGBUS handler is x86-64 Linux only")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"Error: {path} changed while mapped (SIGBUS")
