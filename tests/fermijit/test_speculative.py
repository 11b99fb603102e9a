"""Speculative decoding with the MTP head (fermijit/speculative.py, issue 32 items 2 and 5): at
temperature 0 the tokens are greedy decoding's and the final state is its state bit for bit;
a rollback leaves the state as if the rejected tokens had never been fed; the prefix cache
snapshots only settled states.

A tiny model's random head is rejected almost always, so the loop is also run with an oracle
drafter: the head still runs (its rows are kept as ever) but the drafts are the greedy
continuation, each wrong with probability WRONG, which exercises acceptances, partial ones and
stops inside a step.
"""

from __future__ import annotations

import numpy as np
import pytest

from fermijit import engine, speculative
from fermijit.jit import cpu
from fermijit.model import batch, convert
from fermijit.model.forward import load_model
from fermijit.model.state import GdnState, KvCache, KvKind
from fermijit.ops.kv_quant import Q8Rows
from fermijit.ops.sampling import Sampler
from tests.model import tiny

WRONG = 0.3  # the oracle drafter's share of wrong drafts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    convert.convert(tiny.write_checkpoint(root / "hf", model=tiny.MTP), root / "fj",
                    show_progress=False)
    return root / "fj"


@pytest.fixture(params=["default", "ssse3"])
def model(request, model_dir, monkeypatch):
    """The model decoding in jit.cpu.decode_isa's variant: the process's, or SSSE3 (a fresh
    model: its decode workspace is laid out on first use), as tests/model/test_batch.py."""
    if request.param == "ssse3":
        if cpu.selected_isa() is cpu.Isa.SSSE3:
            pytest.skip("the process's variant is SSSE3 already")
        monkeypatch.setattr(cpu, "_decode", cpu.Isa.SSSE3)
    return load_model(model_dir)[1]


def greedy():
    return Sampler(320, temperature=0, top_k=0, top_p=1.0, seed=0)


class Oracle(speculative.Speculator):
    """Drafts the greedy continuation `truth` (prompt included), wrong with probability WRONG."""

    def __init__(self, model, sampler, n_draft, truth, rng):
        super().__init__(model, sampler, speculative.Drafts(n_draft))
        self.truth, self.rng = truth, rng

    def draft(self, state, token, n):
        drafts, dists = super().draft(state, token, n)
        at = state.position + 1                          # truth index of the first draft
        for i in range(n):
            if at + i < len(self.truth) and self.rng.random() > WRONG:
                drafts[i] = self.truth[at + i]
        return drafts, dists


def values(rows) -> np.ndarray:
    """A KV cache's rows as fp32 values (a Q8_0 cache's codes times their scales)."""
    return rows.dequantize() if isinstance(rows, Q8Rows) else rows


def assert_states_equal(a, b, what=""):
    """Every array a state holds, bit for bit: KV rows [0, position), GDN states, the head's
    waiting hidden states and its cache rows below them (rows past are never read)."""
    assert a.position == b.position, what
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        assert type(x) is type(y)
        if isinstance(x, KvCache):
            n = a.position if i < len(a.layers) - (a.hidden is not None) else \
                a.position - a.hidden.shape[0]
            for j, (p, q) in enumerate(zip(x.rows(0, n).arrays, y.rows(0, n).arrays)):
                np.testing.assert_array_equal(p, q, f"{what} layer {i} kv array {j}")
        else:
            np.testing.assert_array_equal(x.conv, y.conv, f"{what} layer {i} conv")
            np.testing.assert_array_equal(x.recurrent, y.recurrent, f"{what} layer {i} state")
    assert len(a.layers) == len(b.layers)
    if a.hidden is not None or b.hidden is not None:
        np.testing.assert_array_equal(a.hidden, b.hidden, f"{what} hidden")


def run(model, prompt, max_tokens, eos=frozenset(), context=96, n_draft=0, speculator=None,
        cache=None):
    """generate's decode, with `speculator` in place of its own (the oracle's)."""
    original = speculative.Speculator
    if speculator is not None:
        speculative.Speculator = lambda *args: speculator
    try:
        tokens, stats = engine.generate(model, prompt, greedy(), max_tokens, context, eos,
                                        lambda t: None, cache=cache,
                                        drafts=speculative.Drafts(n_draft) if n_draft else None)
    finally:
        speculative.Speculator = original
    return tokens, stats


def test_greedy_text_and_state_are_decodings(model, rng):
    for trial in range(6):
        prompt = rng.integers(0, 300, int(rng.integers(1, 30))).astype(np.int32)
        max_tokens = int(rng.integers(1, 40))
        want, _ = run(model, prompt, max_tokens)
        truth = list(prompt) + want
        # an eos inside the text (decoding stops there), or none
        eos = frozenset({want[len(want) // 2]} if trial % 2 and len(want) > 2 else set())
        want_eos, _ = run(model, prompt, max_tokens, eos)
        for n_draft in (1, 2, 3):
            for kind in ("head", "oracle"):
                oracle = (Oracle(model, greedy(), n_draft, truth, rng) if kind == "oracle"
                          else None)
                got, stats = run(model, prompt, max_tokens, eos, n_draft=n_draft,
                                 speculator=oracle)
                assert got == (want_eos if eos else want), (trial, n_draft, kind)
                assert stats.speculative is not None
                if kind == "oracle" and len(got) > 4:
                    assert stats.speculative.accepted > 0


def test_final_state_is_decodings(model, rng):
    # The state speculative decoding leaves (and snapshots) is plain decoding's, bit for bit.
    prompt = rng.integers(0, 300, 11).astype(np.int32)
    want, _ = run(model, prompt, 30)
    truth = list(prompt) + want
    for max_tokens in (1, 2, 7, 30):
        for n_draft in (1, 3):
            states = []
            for speculator in (None, Oracle(model, greedy(), n_draft, truth, rng)):
                cache = Spy()
                run(model, prompt, max_tokens, n_draft=n_draft if speculator else 0,
                    speculator=speculator, cache=cache)
                states.append(cache.added[-1])  # the prompt's, then the generation's
            (tokens, plain, _), (tokens_spec, spec, _) = states
            assert np.array_equal(tokens, tokens_spec)
            assert spec.hidden.shape[0] == 1                  # settled: one waiting
            spec.layers, spec.hidden = spec.layers[:-1], None  # the head's part aside
            assert_states_equal(plain, spec, f"max_tokens {max_tokens}, {n_draft} drafts")


class Spy:
    """A prefix cache that records copies of what it is asked to snapshot (and restores
    nothing)."""

    snapshot_every = 1 << 30

    def __init__(self):
        self.added = []

    def restore(self, prompt, context):
        return None, None

    def add(self, tokens, state, logits=None):
        self.added.append((np.array(tokens), state.copy(), None if logits is None
                           else np.array(logits)))


def test_rollback_is_never_having_seen_the_tokens(model, rng):
    prompt = rng.integers(0, 300, 9).astype(np.int32)
    tokens = rng.integers(0, 300, 4).astype(np.int32)
    for n_rows in (2, 3, 4):
        for kept in range(1, n_rows + 1):
            state = model.new_state(32, mtp=True)
            model.prefill(prompt, state)
            fresh = state.copy()
            ws, saves = batch.BatchWorkspace(model, n_rows), batch.GdnSaves(model, n_rows)
            got = batch.decode_rows(model, tokens[:n_rows], [state] * n_rows, ws,
                                    [saves] * n_rows).copy()
            batch.rollback(model, state, saves, n_rows, kept)
            for t in tokens[:kept]:
                want = model.decode(int(t), fresh)
            np.testing.assert_array_equal(got[kept - 1], want)
            assert_states_equal(fresh, state, f"{n_rows} rows, {kept} kept")


def test_steps_with_the_last_row_pending_are_decodings(model, rng):
    # Verify steps in a row as a speculator runs them: a 2-row step leaves its last row's GDN
    # update pending (ops/gdn_rows.py), which the next 2-row step applies as it reads the state,
    # a rollback of that row drops, and every other reader settles first: a 3-row step, a
    # copy (a snapshot), plain and batched decode. Each kept row's logits and the state are
    # plain decoding's over the kept tokens, bit for bit.
    prompt = rng.integers(0, 300, 9).astype(np.int32)
    state = model.new_state(64, mtp=True)
    model.prefill(prompt, state)
    fresh = state.copy()
    spaces = {n: (batch.BatchWorkspace(model, n), batch.GdnSaves(model, n)) for n in (2, 3)}
    gdn = [s for s in state.layers if isinstance(s, GdnState)]
    steps = ((2, 2), (2, 2), (2, 1), (2, 2), "copy", (2, 2), (3, 2), (2, 2), (3, 3), (2, 1),
             (2, 1), (2, 2), (2, 2))
    for t, step in enumerate(steps):
        what = f"step {t} {step}"
        if step == "copy":
            assert_states_equal(fresh, state.copy(), what)
            assert not any(s.pending.is_set[0] for s in gdn)  # settled in place
            continue
        n_rows, kept = step
        tokens = rng.integers(0, 300, n_rows).astype(np.int32)
        ws, saves = spaces[n_rows]
        got = batch.decode_rows(model, tokens, [state] * n_rows, ws, [saves] * n_rows).copy()
        batch.rollback(model, state, saves, n_rows, kept)
        assert all(bool(s.pending is not None and s.pending.is_set[0])
                   == (n_rows == kept == 2) for s in gdn), what
        for r in range(kept):
            np.testing.assert_array_equal(got[r], model.decode(int(tokens[r]), fresh), what)
    assert any(s.pending.is_set[0] for s in gdn)
    np.testing.assert_array_equal(model.decode(5, state), model.decode(5, fresh))
    assert not any(s.pending.is_set[0] for s in gdn)
    batch.decode_rows(model, [7, 8], [state] * 2, *spaces[2][:1], [spaces[2][1]] * 2)
    other, other_fresh = fresh.copy(), fresh.copy()
    model.decode(7, fresh)
    model.decode(8, fresh)                   # both rows kept: the second pending
    got = batch.decode_batch(model, [9, 4], [state, other]).copy()
    np.testing.assert_array_equal(got[0], model.decode(9, fresh))
    np.testing.assert_array_equal(got[1], model.decode(4, other_fresh))
    assert_states_equal(fresh, state, "after batched decode")
    batch.decode_rows(model, [3, 2], [state] * 2, *spaces[2][:1], [spaces[2][1]] * 2)
    model.decode(3, fresh)
    model.decode(2, fresh)
    assert all(s.pending.is_set[0] for s in gdn)
    more = rng.integers(0, 300, 5).astype(np.int32)
    for s in (state, fresh):  # the head's part aside (its waiting rows: the speculator's)
        s.layers, s.hidden = s.layers[:-1], None
    np.testing.assert_array_equal(model.prefill(more, state), model.prefill(more, fresh))
    assert_states_equal(fresh, state, "after a prefill")


def test_prefix_cache_snapshots_settled_states(model, rng):
    # A generation's end snapshot is its fed tokens' state with one hidden state waiting (the
    # head's rows settled), which a later prompt extending it resumes from: its prefill and the
    # head's rows then equal a fresh speculative run's.
    from fermijit.cache.prefix_cache import PrefixCache

    prompt = rng.integers(0, 300, 10).astype(np.int32)
    want, _ = run(model, prompt, 25)
    truth = list(prompt) + want
    cache = PrefixCache("test", snapshot_every=4)
    added = []
    original_add = cache.add

    def spy(tokens, state, logits=None, to_disk=True):
        assert state.position == len(tokens) and state.hidden.shape[0] == 1
        added.append((np.array(tokens), state.copy()))
        original_add(tokens, state, logits, to_disk)

    cache.add = spy
    got, _ = run(model, prompt, 25, n_draft=3, cache=cache,
                 speculator=Oracle(model, greedy(), 3, truth, rng))
    assert got == want
    tokens, state = added[-1]
    assert list(tokens) == truth[:len(tokens)] and len(tokens) == len(truth) - 1
    # Its head rows (and the restored state's) are a fresh prefill's of the same tokens.
    fresh = model.new_state(96, mtp=True)
    model.prefill(tokens, fresh)
    for a, b, what in ((state, fresh, "snapshot"),
                       (cache.restore(np.asarray(truth + [5], np.int32), 96)[0], fresh,
                        "restored")):
        n = a.position - 1
        kv, kv_fresh = (values(s.layers[-1].k[:, :n]) for s in (a, b))
        err = np.abs(kv - kv_fresh).max() / np.abs(kv_fresh).max()
        # decode's and prefill's bits differ by rounding only (in a Q8_0 cache, a code at a tie
        # one step the other way: 1/127 of its block's largest)
        assert err < (1e-4 if model.kv_kind is KvKind.F32 else 1 / 127), what
        assert np.abs(a.hidden - b.hidden).max() < 1e-4 * np.abs(b.hidden).max(), what


def test_bad_settings_are_refused(model_dir, tmp_path):
    from fermijit import FermijitError

    _, model = load_model(model_dir)
    with pytest.raises(FermijitError, match="--draft must be between"):
        speculative.Drafts(0)
    with pytest.raises(FermijitError, match="--draft-vocab must be between"):
        speculative.Speculator(model, greedy(), speculative.Drafts(1, model.vocab_size + 1))
    lone = tiny.write_checkpoint(tmp_path / "hf", model=tiny.HF_INIT)
    convert.convert(lone, tmp_path / "fj", show_progress=False)
    with pytest.raises(FermijitError, match="no MTP head"):
        engine.Engine.load(tmp_path / "fj", speculative=True)


ISA_RUN = """
import json, sys
import numpy as np
from fermijit.jit import cpu
cpu.select_isa(sys.argv[2])
from fermijit import engine
from fermijit.model.forward import load_model
from fermijit.ops.kv_quant import Q8Rows
from fermijit.ops.sampling import Sampler
from fermijit.speculative import Drafts
_, model = load_model(sys.argv[1])
rng = np.random.default_rng(5)
same = []
for n in (3, 11, 20, 7):
    prompt = rng.integers(0, 300, n).astype(np.int32)
    runs = [engine.generate(model, prompt, Sampler(model.vocab_size, temperature=0, top_k=0,
                                                   top_p=1.0, seed=0), 24, 64, frozenset(),
                            lambda t: None, drafts=d)[0]
            for d in (None, Drafts(1), Drafts(3), Drafts(2, vocab=160))]
    same.append(all(r == runs[0] for r in runs))
print(json.dumps({"isa": cpu.selected_isa().label, "same": same}))
"""


@pytest.mark.parametrize("isa", ["ssse3", "avx2", "avx512vnni"])
def test_greedy_text_is_decodings_on_every_isa(model_dir, isa):
    # The whole process at `--isa`: prefill and decode kernels of that variant (SSSE3 also
    # compiled for Westmere), greedy text with 1 and 3 drafts against plain decoding's.
    import json
    import subprocess
    import sys

    if not cpu.supported(next(i for i in cpu.Isa if i.label == isa)):
        pytest.skip(f"this CPU has no {isa}")
    if isa == cpu.selected_isa().label:
        pytest.skip("the process's own variant: the tests above ran it")
    out = subprocess.run([sys.executable, "-c", ISA_RUN, str(model_dir), isa],
                         capture_output=True, text=True, timeout=900, env=cpu.child_env())
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["isa"] == isa and all(result["same"]), result


def test_the_end_of_the_context(model_dir, rng):
    # Steps shrink their drafts to the room left, the last position is a plain decode, and the
    # text stops where decoding's does.
    _, model = load_model(model_dir)
    prompt = rng.integers(0, 300, 10).astype(np.int32)
    for context in (11, 12, 13, 16):
        want, stats = run(model, prompt, 40, context=context)
        assert stats.stop is engine.Stop.CONTEXT
        for n_draft in (1, 3):
            got, spec = run(model, prompt, 40, context=context, n_draft=n_draft)
            assert got == want and spec.stop is engine.Stop.CONTEXT, (context, n_draft)


# The sampling loop end to end on the embedded model (its trained head accepts a share of the
# drafts), top-k 2 at temperature 1. (1) What the loop hands the rejection rule (ops.sampling
# .speculative, tested statistically on its own in tests/ops/test_sampling.py): p[i] is exactly
# the model's distribution after the fed token and drafts d_1..d_i (plain decodes of them), q[i]
# a distribution whose support holds d_i. (2) The first two tokens' joint distribution over
# SAMPLING_RUNS runs against the model's own, computed exactly by decoding each of the 2 + 4
# prefixes: each of the 4 probabilities within SAMPLING_SIGMAS binomial standard deviations (a
# coarse check on this 2-core machine: ~0.3 s a run under load).
SAMPLING_RUNS = 600
SAMPLING_SIGMAS = 5


def test_sampling_hands_the_rule_the_models_distributions(monkeypatch):
    from fermijit.ops import sampling

    _, model = load_model(engine.DEFAULT_MODEL)
    if model.mtp is None:
        pytest.skip("the embedded model has no MTP head")
    prompt = np.array([0, 1500, 44, 302, 17, 9, 251], np.int32)
    settings = dict(temperature=1.0, top_k=2, top_p=1.0)
    base = model.new_state(prompt.size + 12, mtp=True)
    first = model.prefill(prompt, base)

    def dist(logits):
        return sampling.probabilities(logits, **settings)

    calls = []
    rule = sampling.speculative
    monkeypatch.setattr(sampling, "speculative",
                        lambda p, q, d, rng: calls.append(([x.copy() for x in p],
                                                           [x.copy() for x in q], list(d)))
                        or rule(p, q, d, rng))
    sampler = Sampler(model.vocab_size, seed=3, **settings)
    state, plain = base.copy(), base.copy()
    speculator = speculative.Speculator(model, sampler, speculative.Drafts(2))
    token = sampler.sample(first)
    for _ in range(4):
        fed_before = state.position
        new, _ = speculator.step(state, token)
        p, q, drafts = calls[-1]
        shadow = plain.copy()
        for i, t in enumerate([token] + drafts):
            np.testing.assert_array_equal(p[i], dist(model.decode(int(t), shadow)))
        for i, d in enumerate(drafts):
            assert abs(q[i].sum() - 1) < 1e-9 and q[i][d] > 0
        for t in [token] + new[:-1]:                  # the plain state follows what was fed
            model.decode(int(t), plain)
        assert plain.position == state.position == fed_before + len(new)
        token = new[-1]
    monkeypatch.setattr(sampling, "speculative", rule)

    p1 = dist(first)
    exact = {}
    for a in np.flatnonzero(p1):
        p2 = dist(model.decode(int(a), base.copy()))
        exact.update({(a, b): p1[a] * p2[b] for b in np.flatnonzero(p2)})
    counts = dict.fromkeys(exact, 0)
    accepted = 0
    for _ in range(SAMPLING_RUNS):
        speculator = speculative.Speculator(model, sampler, speculative.Drafts(1))
        out = [sampler.sample(first)]
        out += speculator.step(base.copy(), out[0])[0]
        counts[tuple(out[:2])] += 1
        accepted += speculator.counts.accepted
    assert accepted > SAMPLING_RUNS // 20                      # the rule's accept path ran
    for key, p in exact.items():
        freq = counts[key] / SAMPLING_RUNS
        bound = SAMPLING_SIGMAS * np.sqrt(p * (1 - p) / SAMPLING_RUNS) + 1e-9
        assert abs(freq - p) <= bound, (key, freq, p)


def test_prefill_batch_with_the_head_is_each_alone(model, rng):
    # The server prefills prompts together (Model.prefill_batch); each state's head rows and
    # waiting hidden state are those of its prefill alone, bit for bit, whatever the passes.
    prompts = [rng.integers(0, 300, n).astype(np.int32) for n in (19, 4, 40)]
    alone = [model.new_state(64, mtp=True) for _ in prompts]
    want = [model.prefill(p, s).copy() for p, s in zip(prompts, alone)]
    together = [model.new_state(64, mtp=True) for _ in prompts]
    got = model.prefill_batch(prompts, together, max_rows=16)
    for b in range(len(prompts)):
        np.testing.assert_array_equal(got[b], want[b])
        assert_states_equal(alone[b], together[b], f"sequence {b}")


def test_bench_decode_speculative_reports_steps_and_costs(model_dir, capsys):
    """`bench decode --speculative mtp` (item 4): tok/s both ways from the same prompts, the
    texts identical, tokens per step and acceptance from the steps' counts, the parts' costs,
    and the projection at the reported acceptances by its printed formula."""
    import json

    from fermijit.bench import decode as bench_decode, speculative as bench_speculative

    r = bench_decode.run(model_dir, None, 8, 6, 1, True, False,
                         speculative=(None, 2, speculative.Drafts()))
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(r))
    assert r["identical_text"] and r["prompts"] == 2 and r["steps"] >= 5
    assert 0 <= r["acceptance"] <= 1 and 1 <= r["tokens_per_step"] <= 2  # one draft a step
    c = r["costs"]
    assert min(v for v in c.values() if not isinstance(v, list)) > 0
    assert r["bytes_per_accepted_token"] > 0
    # Each round's paired ratios (verify, draft over the same round's token), their medians
    # reported and projected from
    ratios, drafts = c["verify_ratios"], c["draft_ratios"]
    assert len(ratios) == len(drafts) == bench_speculative.ROUNDS and min(ratios + drafts) > 0
    assert r["verify_of_decode"] == pytest.approx(np.median(ratios))
    assert r["verify_of_decode_iqr"] == pytest.approx(np.percentile(ratios, [25, 75]))
    assert r["draft_of_decode"] == pytest.approx(np.median(drafts))
    # The byte bound: the rows' union of experts (a token's k to 2k a layer), more bytes.
    assert r["verify_bytes_of_decode"] == pytest.approx(c["verify_bytes"] / c["decode_bytes"])
    k, n_experts = r["experts_per_layer"]
    assert k == int(k) >= 1 and k <= n_experts <= 2 * k and 1 < r["verify_bytes_of_decode"] < 2
    for p, a in zip(r["projection"], bench_speculative.ACCEPTANCE):
        assert p["speedup"] == pytest.approx((1 + a) / (np.median(ratios) + np.median(drafts)))
        assert p["speedup_verify_only"] == pytest.approx((1 + a) / np.median(ratios))
    assert len(r["load_1min"]) == 2
    # The split: every label's best ms in a token and in the verify step; the verify step's
    # GDN rows in one call, the token's through decode's step, the rollback the verify's alone.
    split = r["split"]
    assert split["gdn_rows.cpu"][0] == 0 < split["gdn_rows.cpu"][1]
    assert split["gdn_step.cpu"][1] == 0 < split["gdn_step.cpu"][0]
    assert split["rollback"][0] == 0 < split["rollback"][1] <= c["verify_ms"]
    assert split["moe.decode"][0] > 0 and split["moe.decode"][1] > 0
    assert 0 < sum(v for _, v in split.values()) <= 2 * c["verify_ms"]
    text = bench_speculative.format_report(r)
    assert "acceptance" in text and "(1 + a) * t_decode / (t_verify + t_draft)" in text
    assert "gdn_rows.cpu" in text and "rollback" in text and "the byte bound" in text


def test_an_hf_checkpoint_with_a_head_loads_with_the_default_speculation(model_dir):
    """`serve` and `generate` default to --speculative auto, which asks whether drafting pays:
    an HF checkpoint (fp32 experts, bytes not counted) loads with it off instead of failing."""
    from fermijit.engine import Engine

    engine = Engine.load(model_dir.parent / "hf", speculative=None)
    assert not speculative.pays(engine.model)


def test_auto_drafts_where_a_token_reads_enough_bytes_and_the_measured_costs_pay(model_dir,
                                                                                  monkeypatch):
    """`--speculative auto`: on for a model reading PAYS_MIN_BYTES a token or more where the
    measured verify and draft costs project PAYS_MIN_SPEEDUP at the expected acceptance; off for
    a small model, and off at the costs measured so far (1.36x + 0.21x: 1.11x)."""
    from types import SimpleNamespace

    from fermijit.model import token_bytes

    _, model = load_model(model_dir)
    assert not speculative.pays(model)                      # the tiny model: a few MB a token
    monkeypatch.setattr(token_bytes, "token_bytes",
                        lambda m, k: SimpleNamespace(total=speculative.PAYS_MIN_BYTES))
    assert not speculative.pays(model)                      # today's costs: 1.11x
    monkeypatch.setattr(speculative, "VERIFY_COST", 1.2)    # 1.75 / 1.41 = 1.24x
    assert speculative.pays(model)
    monkeypatch.setattr(speculative, "VERIFY_COST", 2.2)
    assert not speculative.pays(model)
