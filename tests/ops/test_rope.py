"""rope.cpu against the numpy reference, the reference against transformers (MODEL.md §5.4)."""

import numba
import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import rope
from tests import hf
from tests.numerics import assert_close, poisoned

# Both sides take angles in fp64; cpu rounds cos/sin to fp32 and rotates in fp32 (two products
# and a sum, maybe fused): a few ulps of |x|. Measured max abs error 9.5e-7 on |x| up to ~15.
ATOL, RTOL = 2e-6, 1e-6
# transformers takes angles in fp32: below position 512 an angle is off by up to ~6e-5 rad (a few
# ulps of pos·inv_j), times |x| up to ~15 (measured 1.8e-4 over 200 tokens).
ORACLE_ATOL, ORACLE_RTOL = 1e-3, 1e-5

MODEL_THETA = 1e7
CASES = {  # (T, H, D, R, theta); the last is past TABLE_MIN_ELEMENTS (cached angle tables)
    "T1-H16-D256-R64": (1, 16, 256, 64, MODEL_THETA),
    "T5-H2-D256-R64": (5, 2, 256, 64, MODEL_THETA),
    "T63-H4-D60-R20": (63, 4, 60, 20, 1e4),
    "T7-H3-D64-R64": (7, 3, 64, 64, 1e4),
    "T3-H1-D10-R2": (3, 1, 10, 2, 500.0),
    "T20-H18-D256-R64": (20, 18, 256, 64, MODEL_THETA),
    "T67-H18-D256-R64": (67, 18, 256, 64, MODEL_THETA),  # odd rows over the threads
}


def _inputs(rng, n_tokens, n_heads, d, max_position=262144):
    x = (3 * rng.standard_normal((n_tokens, n_heads, d))).astype(np.float32)
    positions = rng.integers(0, max_position, n_tokens).astype(np.int64)
    positions[0] = 0  # the identity rotation
    return x, positions


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_rope(rng, case):
    n_tokens, n_heads, d, rotary_dim, theta = case
    x, positions = _inputs(rng, n_tokens, n_heads, d)
    out = poisoned(x.shape)
    y = rope.cpu(x, positions, rotary_dim, theta, out=out)
    assert y is out
    expected = rope.reference(x, positions, rotary_dim, theta)
    assert_close("rope", expected, y, ATOL, RTOL)
    np.testing.assert_array_equal(y[0], x[0])  # position 0
    np.testing.assert_array_equal(y[..., rotary_dim:], x[..., rotary_dim:])  # pass-through


def test_tables_give_each_tokens_own_bits(rng):
    """A prefill-sized call (angle tables, cached) rotates every token to the bits a one-token
    call (decode's kernel, angles in the loop) gives it, in place or not, with the table cached."""
    x, positions = _inputs(rng, 20, 18, 256)
    assert x.size >= rope.TABLE_MIN_ELEMENTS
    whole = rope.cpu(x, positions, 64, MODEL_THETA)
    for t in range(20):
        one = rope.cpu(x[t:t + 1], positions[t:t + 1], 64, MODEL_THETA)
        assert np.array_equal(one, whole[t:t + 1]), t
    again = x.copy()
    assert np.array_equal(rope.cpu(again, positions, 64, MODEL_THETA, out=again), whole)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU: nothing to compare")
def test_tables_same_bits_for_any_thread_count(rng):
    """Prefill's tokens over the threads: the same bits at 1 and 2 threads (odd token count),
    each token's a one-token call's."""
    x, positions = _inputs(rng, 67, 18, 256)
    before = numba.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            numba.set_num_threads(n)
            results.append(rope.cpu(x, positions, 64, MODEL_THETA, out=poisoned(x.shape)))
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(*results)
    for t in range(0, 67, 11):
        assert np.array_equal(rope.cpu(x[t:t + 1], positions[t:t + 1], 64, MODEL_THETA),
                              results[0][t:t + 1]), t


def test_in_place(rng):
    x, positions = _inputs(rng, 9, 4, 256)
    expected = rope.reference(x, positions, 64, MODEL_THETA)
    assert rope.cpu(x, positions, 64, MODEL_THETA, out=x) is x
    assert_close("rope in place", expected, x, ATOL, RTOL)


def test_rotation_is_relative(rng):
    # q at position m and k at position n: their rotary dot product depends only on m - n.
    q, _ = _inputs(rng, 1, 1, 64)
    k, _ = _inputs(rng, 1, 1, 64)

    def dot(m, n):
        qm = rope.cpu(q, np.array([m], np.int64), 64, MODEL_THETA)
        kn = rope.cpu(k, np.array([n], np.int64), 64, MODEL_THETA)
        return float(np.dot(qm.ravel().astype(np.float64), kn.ravel()))

    assert_close("q.k at shifted positions", dot(10, 3), dot(100010, 100003), 1e-3, 1e-5)


def test_reference_matches_transformers(rng):
    torch = pytest.importorskip("torch")
    qwen = hf.qwen_modeling()
    from transformers import Qwen3_5MoeTextConfig

    n_tokens, n_heads, d = 11, 3, 256
    config = Qwen3_5MoeTextConfig(
        head_dim=d, rope_parameters={"rope_type": "default", "rope_theta": MODEL_THETA,
                                     "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                     "mrope_interleaved": True})
    x, positions = _inputs(rng, n_tokens, n_heads, d, max_position=512)
    xt = torch.from_numpy(x).transpose(0, 1)[None]                       # [1, H, T, D]
    cos, sin = qwen.Qwen3_5MoeTextRotaryEmbedding(config)(xt, torch.from_numpy(positions)[None])
    expected, _ = qwen.apply_rotary_pos_emb(xt, xt, cos, sin)
    expected = expected[0].transpose(0, 1).numpy()                       # [T, H, D]
    assert_close("reference vs transformers", expected,
                 rope.reference(x, positions, 64, MODEL_THETA), ORACLE_ATOL, ORACLE_RTOL)


def test_bad_inputs():
    x = np.zeros((4, 2, 16), np.float32)
    positions = np.arange(4, dtype=np.int64)
    with pytest.raises(FermijitError, match="dtype"):
        rope.cpu(x.astype(np.float64), positions, 8, 1e4)
    with pytest.raises(FermijitError, match="dtype"):
        rope.cpu(x, positions.astype(np.int32), 8, 1e4)
    with pytest.raises(FermijitError, match="shape"):
        rope.cpu(x, positions[:3], 8, 1e4)
    with pytest.raises(FermijitError, match="3-D"):
        rope.cpu(x[0], positions, 8, 1e4)
    with pytest.raises(FermijitError, match="contiguous"):
        rope.cpu(np.zeros((4, 16, 2), np.float32).transpose(0, 2, 1), positions, 8, 1e4)
    for rotary_dim in (0, 7, 18):
        with pytest.raises(FermijitError, match="rotary_dim"):
            rope.cpu(x, positions, rotary_dim, 1e4)
    with pytest.raises(FermijitError, match="theta"):
        rope.cpu(x, positions, 8, 0.0)
    with pytest.raises(FermijitError, match="overlaps"):
        big = np.zeros((5, 2, 16), np.float32)
        rope.cpu(big[:4], positions, 8, 1e4, out=big[1:])


# --- interleaved MRoPE (prompts with images) ---------------------------------------------------

def test_mrope_axes_of_the_real_model():
    """MODEL.md §5.4: "THW" repeated, the W axis only below j = 30, so j = 30 is T, 31 is H."""
    axes = rope.mrope_axes(64, (11, 11, 10))
    assert "".join("THW"[a] for a in axes) == "THW" * 10 + "TH"


@pytest.mark.parametrize("case", [(9, 3, 32, 8, (2, 1, 1)), (40, 2, 256, 64, (11, 11, 10))],
                         ids=["tiny", "real"])
def test_mrope(rng, case):
    n_tokens, n_heads, d, rotary_dim, section = case
    x = (3 * rng.standard_normal((n_tokens, n_heads, d))).astype(np.float32)
    positions = rng.integers(0, 5000, (3, n_tokens)).astype(np.int64)
    out = poisoned(x.shape)
    rope.mrope_cpu(x, positions, rotary_dim, MODEL_THETA, section, out=out)
    assert_close("mrope", rope.mrope_reference(x, positions, rotary_dim, MODEL_THETA, section),
                 out, ATOL, RTOL)
    same = np.tile(positions[0], (3, 1))  # T = H = W: plain 1-D RoPE
    assert_close("mrope of text", rope.cpu(x, positions[0], rotary_dim, MODEL_THETA),
                 rope.mrope_cpu(x, same, rotary_dim, MODEL_THETA, section), ATOL, RTOL)
    y = x.copy()
    rope.mrope_cpu(y, positions, rotary_dim, MODEL_THETA, section, out=y)
    assert_close("in place", out, y, 0, 0)
    with pytest.raises(FermijitError, match="positions"):
        rope.mrope_cpu(x, positions[:2], rotary_dim, MODEL_THETA, section)


# --- far positions (issue 31 item 6: contexts past 64k) ----------------------------------------

FAR = np.array([65536, 65537, 100003, 131071, 131072, 200000, 262142, 262143], np.int64)


def test_far_positions_match_the_reference(rng):
    """Positions past 65,536 up to the model's last (262,143), where an fp32 angle would be off
    by far more than the rotation's tolerance: angles are fp64 (pos · inv_j), cos and sin
    rounded once. One-token calls (decode) and a table-sized call (prefill), and MRoPE."""
    n = FAR.size
    x = (3 * rng.standard_normal((n, 32, 256))).astype(np.float32)
    assert x.size >= rope.TABLE_MIN_ELEMENTS
    expected = rope.reference(x, FAR, 64, MODEL_THETA)
    assert_close("rope, table", expected, rope.cpu(x, FAR, 64, MODEL_THETA), ATOL, RTOL)
    for t in range(n):
        assert_close(f"rope at {FAR[t]}", expected[t:t + 1],
                     rope.cpu(x[t:t + 1], FAR[t:t + 1], 64, MODEL_THETA), ATOL, RTOL)
    positions = np.stack([FAR, FAR[::-1], FAR // 2])                   # T, H, W
    assert_close("mrope", rope.mrope_reference(x, positions, 64, MODEL_THETA, (11, 11, 10)),
                 rope.mrope_cpu(x, positions, 64, MODEL_THETA, (11, 11, 10)), ATOL, RTOL)
    # An fp32 angle is what the tolerance guards against: at these positions it moves the
    # rotation by far more (so the test can fail).
    inv = MODEL_THETA ** (-np.arange(32) * 2 / 64)
    fp32_angle = (FAR[:, None].astype(np.float32) * inv.astype(np.float32)).astype(np.float64)
    assert np.abs(fp32_angle - FAR[:, None] * inv).max() * 3 > 100 * ATOL
