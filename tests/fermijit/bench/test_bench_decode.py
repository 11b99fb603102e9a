"""`bench decode` on a shrunken synthetic model: the report's structure and its arithmetic (the
speeds themselves are not tested: timed tests are noise)."""

from __future__ import annotations

import collections
import json

import numba
import pytest

from fermijit import FermijitError
from fermijit.bench import decode as bench_decode
from fermijit.model import convert, synth
from fermijit.model.safetensors_io import SafetensorsFile
from tests.model.test_synth import SMALL

TOP_K = 8


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    dst = tmp_path_factory.mktemp("bench") / "m"
    synth.synth("qwen3.6-35b-a3b-reap128", dst, layers=4, overrides=SMALL, show_progress=False)
    return dst


@pytest.mark.parametrize("n_tokens, sizes", [(3, [3]), (16, [16]), (40, [20, 20]),
                                             (65, [16, 16, 16, 17])])
def test_windows_cover_the_tokens_once(n_tokens, sizes):
    w = bench_decode.windows(n_tokens)
    assert [len(x) for x in w] == sizes and [t for x in w for t in x] == list(range(n_tokens))


def test_report_structure_and_arithmetic(report, capsys, monkeypatch):
    monkeypatch.setattr(bench_decode, "PROBE_BYTES", 64 << 20)
    r = bench_decode.run(report, None, 8, 3, 1, as_json=True, profile=True)
    printed = json.loads(capsys.readouterr().out)
    assert printed["decode_tok_s"] == pytest.approx(r["decode_tok_s"])
    for key in ("load_s", "warm_up_s", "prefill_tok_s", "decode_tok_s", "read_gbs",
                "ceiling_tok_s", "peak_rss", "peak_anon", "peak_file", "prefill_gflops"):
        assert r[key] > 0, key
    for key in ("decode_major_faults", "decode_read_bytes"):
        assert r[key] >= 0, key
    assert r["threads"] == 1 and r["prompt_tokens"] == 8 and r["decode_tokens"] == 3
    assert r["experts_selected_per_layer"] == [TOP_K] * 4
    assert r["ready_to_decode_s"] == pytest.approx(r["load_s"] + r["warm_up_s"])
    assert r["first_token_s"] > r["ready_to_decode_s"]
    assert r["ceiling_tok_s"] == pytest.approx(r["read_gbs"] * 1e9 / r["bytes_per_token"]["total"])
    assert r["of_ceiling"] == pytest.approx(r["decode_tok_s"] / r["ceiling_tok_s"])
    # The paired measure: every window a probe pass of its own, its rate over its own tokens.
    paired = r["paired"]
    assert paired["window_tokens"] == [3] and all(g > 0 for g in paired["probe_gbs"])
    assert paired["decode_gbs"] == pytest.approx([r["decode_gbs"]])
    assert paired["of_ceiling"] == pytest.approx([d / p for d, p in zip(paired["decode_gbs"],
                                                                        paired["probe_gbs"])])
    assert r["of_ceiling_paired"] == pytest.approx(paired["of_ceiling"][0])

    assert "paired with the probe" in bench_decode.format_report(r)

    # Bytes per token, counted here from the file instead of the model's arrays: everything but
    # the unselected experts, all embedding rows but one and the MTP head (a plain decode's token
    # does not run it).
    stored = {n: t for n, t in SafetensorsFile(report / convert.WEIGHTS).tensors.items()
              if not n.startswith("mtp.")}
    total = sum(t.end - t.begin for t in stored.values())
    E, V = 128, SMALL["vocab_size"]
    routed = sum(t.end - t.begin for n, t in stored.items() if ".experts_" in n)
    embed = stored["embed_tokens"].end - stored["embed_tokens"].begin
    expected = total - routed * (E - TOP_K) // E - embed * (V - 1) // V
    # and the KV cache's rows at the middle decode token's position (issue 31 item 3), Q8_0
    from fermijit.model.forward import load_model
    from fermijit.model.state import GdnState

    fresh = load_model(report)[1].new_state(1)
    per_position = fresh.position_nbytes
    assert r["kv_cache"] == "q8_0" and r["bytes_per_token"]["kv"] == (8 + 3 // 2) * per_position
    # and the GDN layers' recurrent state and conv window, which every token reads (issue 29)
    gdn = [s for s in fresh.layers if isinstance(s, GdnState)]
    assert gdn and r["bytes_per_token"]["state"] == sum(a.nbytes for s in gdn for a in s.arrays)
    assert r["bytes_per_token"]["total"] == (expected + r["bytes_per_token"]["kv"]
                                             + r["bytes_per_token"]["state"])

    rows = {row["op"]: row for row in r["profile"]}
    token = rows.pop("token")
    assert sum(row["ms"] for row in rows.values()) == pytest.approx(token["ms"], rel=1e-6)
    for row in rows.values():
        assert row["kernel_ms"] >= 0 and row["kernel_ms"] <= row["ms"] + 1e-9, row
    # The plan's kernels run joined, a step a layer and one for the head (model/forward.py
    # join_steps): a row a kind of step, labelled with each call's kernel calls by op; the
    # embedding (Python) before them.
    joined = {op: row for op, row in rows.items() if op.startswith("joined ")}
    assert joined and "embedding.cpu" in rows
    assert sum(row["calls"] for row in joined.values()) == 4 + 1
    calls = collections.Counter()
    for op, row in joined.items():
        head, ops = op.split(": ", 1)
        per_call = {name: int(n) for name, n in (part.rsplit(" ", 1) for part in ops.split(", "))}
        assert int(head.removeprefix("joined ")) == sum(per_call.values())
        for name, n in per_call.items():
            calls[name] += n * row["calls"]
        assert row["kernel_ms"] > 0
    assert calls["moe.decode"] == 4 and calls["matvec.product"] > 0
    assert calls["residual_step"] == 2 * 4 + 1  # each sublayer's input, the head's
    assert r["sweep"] == [] and r["sweep_threads"] == []
    prefill = {row["op"]: row for row in r["prefill_profile"]}
    assert prefill["moe.cpu"]["calls"] == 4 and prefill["token"]["ms"] > 0
    # Prefill's prange kernels (the SwiGLU, the weighted sum) apart from serial code; the split
    # covers each op's kernel time.
    assert prefill["moe.cpu"]["split"]["prange"] > 0
    for row in prefill.values():
        s = row.get("split")
        if s:
            assert min(s["serial"], s["prange"], s["idle"], s["fork_join"]) >= 0, row
            assert (s["serial"] + s["prange"] + s["work"] + s["idle"] + s["fork_join"]
                    <= row["kernel_ms"] * 1.01 + 1e-3), row


def test_threads_sweep_reports_each_count_and_splits_its_token(report, capsys, monkeypatch):
    monkeypatch.setattr(bench_decode, "PROBE_BYTES", 64 << 20)
    counts = (1, numba.config.NUMBA_NUM_THREADS)
    r = bench_decode.run(report, None, 4, 2, 1, as_json=False, profile=False, sweep=counts,
                         sweep_tokens=3)
    assert [row["threads"] for row in r["sweep"]] == list(counts)
    assert numba.get_num_threads() == 1  # the main run's count, back after the sweep
    total = r["bytes_per_token"]["total"]
    for row in r["sweep"]:
        assert row["tok_s"] > 0 and row["read_gbs"] > 0 and len(row["paired"]) == 1
        assert row["of_ceiling"] == pytest.approx(row["tok_s"] * total / (row["read_gbs"] * 1e9))
        s = row["split"]
        assert s["regions"] > 0 and s["work"] > 0
        assert min(s["serial"], s["idle"], s["fork_join"]) >= 0
        # The split covers the profiled token's kernel time (regions inside kernels).
        assert s["serial"] + s["work"] + s["idle"] + s["fork_join"] <= row["profile_ms"] + 1e-6
    out = capsys.readouterr().out
    assert "threads sweep" in out and "fork" in out
    with pytest.raises(FermijitError, match="--threads-sweep"):
        bench_decode.run(report, None, 4, 2, 1, as_json=False, profile=False,
                         sweep=(numba.config.NUMBA_NUM_THREADS + 1,))


def test_table_and_bad_input(report, capsys, monkeypatch):
    from fermijit import FermijitError

    monkeypatch.setattr(bench_decode, "PROBE_BYTES", 64 << 20)
    bench_decode.run(report, None, 4, 2, None, as_json=False, profile=False)
    out = capsys.readouterr().out
    for label in ("decode of ceiling", "bytes per token", "read bandwidth", "peak RSS",
                  "load to first token", "prefill of GEMM"):
        assert label in out, label
    with pytest.raises(FermijitError, match="one of --model"):
        bench_decode.run(None, None, 4, 2, None, as_json=False, profile=False)


def test_synthetic_is_built_into_a_temporary_directory(capsys, monkeypatch):
    """--synthetic NAME without --model: built (here shrunk), measured, removed afterwards."""
    real = synth.synth
    made = []

    def small_synth(name, dst, **kwargs):
        made.append(dst)
        return real(name, dst, layers=4, overrides=SMALL, show_progress=False)

    monkeypatch.setattr(synth, "synth", small_synth)
    monkeypatch.setattr(bench_decode, "PROBE_BYTES", 64 << 20)
    r = bench_decode.run(None, "qwen3.6-35b-a3b-reap128", 4, 2, 1, as_json=False, profile=False)
    assert r["synthetic"]["name"] == "qwen3.6-35b-a3b-reap128" and r["synthetic"]["build_s"] > 0
    assert "built in" in capsys.readouterr().out
    assert len(made) == 1 and not made[0].exists()
