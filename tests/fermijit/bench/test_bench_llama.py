"""`bench llama-cpp`: the rounds' order and arithmetic, with both engines' processes stood in for by
canned reports (the engines themselves: tests/fermijit/bench/test_bench_decode.py and the lead's
many-core pass, tests/manycore_pass.sh)."""

from __future__ import annotations

import json

import pytest

from fermijit import FermijitError
from fermijit.bench import llama_cpp as bench_llama

LLAMA_JSON = [{"n_prompt": 16, "n_gen": 0, "avg_ts": 100.0, "build_commit": "abc",
               "cpu_info": "x"},
              {"n_prompt": 0, "n_gen": 4, "avg_ts": 10.0, "build_commit": "abc", "cpu_info": "x"}]


def fermijit_json(decode, prefill):
    return json.dumps({"decode_tok_s": decode, "prefill_tok_s": prefill, "of_ceiling": 0.5,
                       "of_ceiling_paired": 0.6, "read_gbs": 20.0})


def test_rounds_alternate_and_medians_pair(tmp_path, monkeypatch, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    calls = []
    decode = iter([15.0, 30.0, 12.0, 24.0, 18.0, 36.0])  # fermijit per call

    def canned(command, timeout_s, env=None):
        is_fermijit = "fermijit" in command
        calls.append((("fermijit" if is_fermijit else "llama.cpp"),
                      int(command[command.index("--threads" if is_fermijit else "-t") + 1])))
        if is_fermijit:
            assert command[-1] == "--json" and "--pin-threads" in command
            return fermijit_json(next(decode), 300.0)
        return json.dumps(LLAMA_JSON)

    monkeypatch.setattr(bench_llama, "_run", canned)
    r = bench_llama.run(tmp_path / "m", tmp_path / "m.gguf", fake, (1, 2), 3, 16, 4,
                        as_json=False, fermijit_flags=("--pin-threads",))
    # Round 0 fermijit first, round 1 llama.cpp first, ...; every thread count each round.
    assert calls[:4] == [("fermijit", 1), ("llama.cpp", 1), ("fermijit", 2), ("llama.cpp", 2)]
    assert calls[4:8] == [("llama.cpp", 1), ("fermijit", 1), ("llama.cpp", 2), ("fermijit", 2)]
    one, two = r["summary"]
    assert one["decode_tok_s"] == {"fermijit": 15.0, "llama.cpp": 10.0}  # median of 15, 12, 18
    assert two["decode_ratio"] == pytest.approx(3.0)
    assert one["prefill_ratio"] == pytest.approx(3.0) and one["fermijit_of_ceiling_paired"] == 0.6
    assert "decode fj" in capsys.readouterr().out


def test_missing_inputs_and_bad_outputs_are_one_line_errors(tmp_path):
    with pytest.raises(FermijitError, match="no such model directory"):
        bench_llama.run(tmp_path / "none", tmp_path / "x.gguf", tmp_path, (1,), 1, 4, 2, False)
    (tmp_path / "m").mkdir()
    with pytest.raises(FermijitError, match="no such GGUF"):
        bench_llama.run(tmp_path / "m", tmp_path / "x.gguf", tmp_path, (1,), 1, 4, 2, False)
    with pytest.raises(FermijitError, match="no pp16 and tg4"):
        bench_llama.parse_llama(json.dumps(LLAMA_JSON[:1]), 16, 4)
    with pytest.raises(FermijitError, match="printed no report"):
        bench_llama.parse_fermijit("not json")
    with pytest.raises(FermijitError, match="failed"):
        bench_llama._run(["false"], 10)
