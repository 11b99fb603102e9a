"""sampling: greedy, the top-k / top-p distributions, cpu == reference draw by draw, Sampler."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import sampling

N_DRAWS = 300          # u values per cpu-vs-reference case
N_FREQ_DRAWS = 20000   # Sampler draws for the empirical frequencies
FREQ_SIGMAS = 5        # a frequency may stray 5 binomial standard deviations (p ~ 6e-7 each)
U_GRID = 10000         # u = (i + 1/2) / U_GRID: the reference's token distribution, to 1e-4

SETTINGS = {  # (temperature, top_k, top_p)
    "t1-all": (1.0, 0, 1.0),
    "t0.7-k20-p0.8": (0.7, 20, 0.8),
    "t1.3-k50": (1.3, 50, 1.0),
    "t0.5-p0.9": (0.5, 0, 0.9),
    "t1-k1000-p0.95": (1.0, 1000, 0.95),
    "t2-kV": (2.0, 4099, 1.0),
    "t0.9-k5000": (0.9, 5000, 1.0),   # top_k > V: all tokens
}


def _logits(rng, vocab, spread=3.0):
    return (spread * rng.standard_normal(vocab)).astype(np.float32)


@pytest.mark.parametrize("vocab", [1, 7, 1000, 4099])
def test_greedy_is_argmax(rng, vocab):
    logits = _logits(rng, vocab)
    top = int(np.argmax(logits))
    logits[vocab // 2:] = np.maximum(logits[vocab // 2:], logits[top])  # ties: lowest id wins
    top = int(np.argmax(logits))
    for u in (0.0, 0.5, 0.999):
        assert sampling.reference(logits, 0.0, 0, 1.0, u) == top
        assert sampling.cpu(logits, 0.0, 0, 1.0, u) == top
        assert sampling.cpu(logits, 0, 40, 0.3, u) == top  # greedy ignores top_k and top_p


def test_top_k_1_and_tiny_top_p_are_greedy(rng):
    logits = _logits(rng, 4099)
    logits[[17, 3000]] = logits.max() + 1.0  # tied best: the lower id
    for u in rng.random(20):
        for temperature, top_k, top_p in ((0.8, 1, 1.0), (1.5, 0, 1e-9), (1.0, 100, 1e-9)):
            assert sampling.reference(logits, temperature, top_k, top_p, u) == 17
            assert sampling.cpu(logits, temperature, top_k, top_p, u) == 17


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_cpu_matches_reference(rng, settings):
    temperature, top_k, top_p = settings
    vocab = 4099
    heap = np.full(sampling.heap_size(vocab, top_k), -1, np.int32)
    for logits in (_logits(rng, vocab),
                   np.round(_logits(rng, vocab, 1.0) * 2) / 2):   # many exact ties
        logits = logits.astype(np.float32)
        for u in rng.random(N_DRAWS):
            assert sampling.cpu(logits, temperature, top_k, top_p, u, scratch=heap) == \
                sampling.reference(logits, temperature, top_k, top_p, u), u


def test_exact_boundaries():
    # Four equal logits: p = 1/4 each, and every cumulative sum is exact. The nucleus is the first
    # prefix whose mass *reaches* top_p, and the draw is the first token whose cdf *exceeds* u.
    logits = np.zeros(4, np.float32)
    for settings, u, token in (((1.0, 0, 0.5), 0.7, 1),     # nucleus {0, 1}, not {0, 1, 2}
                               ((1.0, 0, 1.0), 0.25, 1),    # cdf [.25, .5, .75, 1] at u = .25
                               ((1.0, 0, 1.0), 0.0, 0),
                               ((1.0, 3, 1.0), 2 / 3, 2)):  # cdf [1/3, 2/3, 1] at u = 2/3
        assert sampling.reference(logits, *settings, u) == token, (settings, u)
        assert sampling.cpu(logits, *settings, u) == token, (settings, u)


def test_full_vocabulary(rng):
    # The real vocabulary with top_k small (a partial selection) and with a nucleus over all of it.
    vocab = 248320
    logits = _logits(rng, vocab, 2.0)
    for settings in ((0.7, 20, 0.8), (1.0, 0, 0.9)):
        for u in rng.random(4):
            assert sampling.cpu(logits, *settings, u) == sampling.reference(logits, *settings, u)


def _grid_probabilities(logits, temperature, top_k, top_p):
    """The reference's token distribution: the share of a fine grid of u mapping to each token."""
    u = (np.arange(U_GRID) + 0.5) / U_GRID
    tokens = [sampling.reference(logits, temperature, top_k, top_p, float(x)) for x in u]
    return np.bincount(tokens, minlength=logits.size) / U_GRID


def test_reference_distribution():
    # p = [0.5, 0.25, 0.15, 0.1] (token order shuffled). top_p 0.7: the nucleus is the two most
    # likely (0.5, then 0.75 >= 0.7), renormalised to 2/3, 1/3.
    p = np.array([0.15, 0.5, 0.1, 0.25])
    logits = np.log(p).astype(np.float32)
    cases = [((1.0, 0, 1.0), p), ((1.0, 0, 0.7), [0, 2 / 3, 0, 1 / 3]),
             ((1.0, 3, 1.0), [0.15 / 0.9, 0.5 / 0.9, 0, 0.25 / 0.9]),
             ((1.0, 3, 0.8), [0, 2 / 3, 0, 1 / 3]),    # renormalised top-3: 5/9 + 5/18 >= 0.8
             ((0.5, 0, 1.0), p ** 2 / np.sum(p ** 2))]
    for settings, expected in cases:
        got = _grid_probabilities(logits, *settings)
        np.testing.assert_allclose(got, expected, atol=2.0 / U_GRID, err_msg=str(settings))


FREQ_SETTINGS = {"t0.8-k5-p0.9": (0.8, 5, 0.9), "t1-all": (1.0, 0, 1.0)}


@pytest.mark.parametrize("settings", FREQ_SETTINGS.values(), ids=FREQ_SETTINGS.keys())
def test_sampler_frequencies(rng, settings):
    logits = _logits(rng, 7, 1.0)
    expected = _grid_probabilities(logits, *settings)
    sampler = sampling.Sampler(7, temperature=settings[0], top_k=settings[1], top_p=settings[2],
                               seed=int(rng.integers(2 ** 32)))
    counts = np.bincount([sampler.sample(logits) for _ in range(N_FREQ_DRAWS)], minlength=7)
    freq = counts / N_FREQ_DRAWS
    bound = FREQ_SIGMAS * np.sqrt(expected * (1 - expected) / N_FREQ_DRAWS) + 2.0 / U_GRID
    assert (np.abs(freq - expected) <= bound).all(), (freq, expected)
    assert (counts[expected == 0] == 0).all()


def test_sampler_is_reproducible(rng):
    logits = _logits(rng, 1000)
    draws = []
    for _ in range(2):
        sampler = sampling.Sampler(1000, temperature=1.0, top_k=40, top_p=0.9, seed=1234)
        draws.append([sampler.sample(logits) for _ in range(50)])
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1


def test_invalid_settings():
    logits = np.zeros(10, np.float32)
    bad = [(-0.1, 0, 1.0), (float("nan"), 0, 1.0), (1.0, -1, 1.0), (1.0, 2.5, 1.0),
           (1.0, 0, 0.0), (1.0, 0, 1.5), (1.0, 0, -0.2), (1.0, 0, float("nan"))]
    for temperature, top_k, top_p in bad:
        for sample in (sampling.reference, sampling.cpu):
            with pytest.raises(FermijitError, match="temperature|top_k|top_p"):
                sample(logits, temperature, top_k, top_p, 0.5)
        with pytest.raises(FermijitError, match="temperature|top_k|top_p"):
            sampling.Sampler(10, temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    for u in (1.0, -0.1, float("nan")):
        for sample in (sampling.reference, sampling.cpu):
            with pytest.raises(FermijitError, match="u must be"):
                sample(logits, 1.0, 0, 1.0, u)


def test_bad_inputs():
    logits = np.zeros(10, np.float32)
    with pytest.raises(FermijitError, match="dtype"):
        sampling.cpu(logits.astype(np.float64), 1.0, 0, 1.0, 0.5)
    with pytest.raises(FermijitError, match="1-D"):
        sampling.cpu(logits.reshape(2, 5), 1.0, 0, 1.0, 0.5)
    with pytest.raises(FermijitError, match="contiguous"):
        sampling.cpu(np.zeros(20, np.float32)[::2], 1.0, 0, 1.0, 0.5)
    with pytest.raises(FermijitError, match="empty"):
        sampling.cpu(np.zeros(0, np.float32), 1.0, 0, 1.0, 0.5)
    with pytest.raises(FermijitError, match="needs 10"):
        sampling.cpu(logits, 1.0, 0, 1.0, 0.5, scratch=np.zeros(9, np.int32))
    with pytest.raises(FermijitError, match="dtype"):
        sampling.cpu(logits, 1.0, 3, 1.0, 0.5, scratch=np.zeros(9, np.int64))
    with pytest.raises(FermijitError, match="shape"):
        sampling.Sampler(10, temperature=1.0, top_k=0, top_p=1.0, seed=0).sample(logits[:9])


# --- speculative decoding (fermijit/speculative.py) ----------------------------------------------

@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_probabilities_are_what_reference_draws_from(rng, settings):
    # Exactly the reference's distribution: every u of a grid maps to a token of it, the mass
    # before that token (in reference's descending order) at most u.
    temperature, top_k, top_p = settings
    vocab = 4099
    for logits in (_logits(rng, vocab), np.round(_logits(rng, vocab, 1.0) * 2) / 2):
        logits = logits.astype(np.float32)
        p = sampling.probabilities(logits, temperature, top_k, top_p)
        assert p.shape == (vocab,) and abs(p.sum() - 1) < 1e-12 and (p >= 0).all()
        kept = np.flatnonzero(p > 0)
        order = np.argsort(-logits, kind="stable")
        n = kept.size
        assert set(order[:n].tolist()) == set(kept.tolist())  # the top of reference's order
        cdf = np.cumsum(p[order[:n]])
        for u in rng.random(50):
            token = sampling.reference(logits, temperature, top_k, top_p, float(u))
            i = int(np.flatnonzero(order[:n] == token)[0])
            assert (cdf[i - 1] if i else 0.0) <= u + 1e-12 and u < cdf[i] + 1e-12


def test_probabilities_small_case():
    p = np.array([0.15, 0.5, 0.1, 0.25])
    logits = np.log(p).astype(np.float32)
    np.testing.assert_allclose(sampling.probabilities(logits, 1.0, 0, 0.7), [0, 2 / 3, 0, 1 / 3],
                               atol=1e-7)
    np.testing.assert_allclose(sampling.probabilities(logits, 1.0, 3, 1.0),
                               [0.15 / 0.9, 0.5 / 0.9, 0, 0.25 / 0.9], atol=1e-7)
    with pytest.raises(FermijitError, match="temperature > 0"):
        sampling.probabilities(logits, 0.0, 0, 1.0)


# The statistical test of the rejection rule: a target Markov chain over a tiny vocabulary (the
# model) and another (the drafter) that disagrees with it. The tokens the rule emits for the first
# three positions must be distributed as the target's own chain; every joint probability of the
# 5^3 sequences within SPEC_SIGMAS binomial standard deviations.
SPEC_VOCAB = 5
SPEC_RUNS = 40000
SPEC_SIGMAS = 5


def _chain(rng, sharpness):
    m = rng.random((SPEC_VOCAB, SPEC_VOCAB)) ** sharpness
    return m / m.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("n_draft", [1, 2, 3])
def test_speculative_rule_keeps_the_distribution(rng, n_draft):
    target, drafter = _chain(rng, 2.0), _chain(rng, 1.0)
    draws = np.random.default_rng(int(rng.integers(2 ** 32)))
    start = 0
    counts = np.zeros((SPEC_VOCAB,) * 3)
    for _ in range(SPEC_RUNS):
        out, last = [], start
        while len(out) < 3:
            drafts, q = [], []
            for _ in range(n_draft):                         # drafts from the drafter's chain
                prev = drafts[-1] if drafts else last
                q.append(drafter[prev])
                drafts.append(sampling.draw(q[-1], draws.random()))
            p = [target[t] for t in [last] + drafts]         # the target after each fed token
            n_ok, token = sampling.speculative(p, q, drafts, draws)
            out += drafts[:n_ok] + [token]
            last = out[-1]
        counts[tuple(out[:3])] += 1
    expected = (target[start][:, None, None] * target[:, :, None]
                * target[None, :, :])                       # p(a) p(b|a) p(c|b)
    freq = counts / SPEC_RUNS
    bound = SPEC_SIGMAS * np.sqrt(expected * (1 - expected) / SPEC_RUNS) + 1e-12
    assert (np.abs(freq - expected) <= bound).all(), np.abs(freq - expected).max()
    # and the drafter's own chain would have failed this (it is far from the target)
    drafted = drafter[start][:, None, None] * drafter[:, :, None] * drafter[None, :, :]
    assert (np.abs(drafted - expected) > bound).any()


def test_speculative_rule_accepts_a_perfect_drafter(rng):
    p = [np.eye(SPEC_VOCAB)[t] for t in (2, 4, 1)]
    n_ok, token = sampling.speculative(p, p[:2], [2, 4], rng)
    assert (n_ok, token) == (2, 1)
