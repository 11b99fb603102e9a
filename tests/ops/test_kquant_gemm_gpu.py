"""GGUF-block GEMMs on the GPU (kernels_ptx/kquant_gemm.ptx, ops/kquant_gemm.py; issue 34:
Q4_K, Q5_K, Q6_K and the fallbacks Q5_0, Q5_1, Q8_0) against the numpy reference (ops/kquant.py
dequantize, llama.cpp's dequantize_row_*): dense on ragged shapes, every weight dequantised bit
for bit, and the expert modes (gathered rows with the SwiGLU, the weighted scatter-add); outputs
poisoned with NaN. Argument checks run without a GPU."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import kquant, kquant_gemm
from tests.gpu import needs_gpu, report_error
from tests.numerics import assert_close, poisoned

# As the Q4_0 GEMMs (tests/ops/test_matmul_gpu.py, issue 5): fp32 sums of K products against
# float64, within 1e-4 of the largest output.
GEMM_REL = 1e-4
FORMATS = list(kquant_gemm.GPU_FORMATS)

# (T, N, K): one row and one output; partial row tiles (64) and column tiles (128) on both
# sides; several 256-blocks (Q4_K's and Q5_K's 8 and Q6_K's 16 scale groups in each, and the
# super-block step); T 130 = three row tiles; K 96 (three 32-blocks) for the 32-value formats.
DENSE = {"T1-N1-K256": (1, 1, 256), "T5-N130-K512": (5, 130, 512),
         "T64-N128-K256": (64, 128, 256), "T130-N300-K768": (130, 300, 768),
         "T67-N257-K1024": (67, 257, 1024), "T9-N70-K96": (9, 70, 96)}
# (T, H, I, E, top-k), H and I whole 256-blocks; T 130 puts more than 64 slots on an expert;
# E 9 with top-8 leaves experts unused.
EXPERTS = {"T1-H256-I256-E4-K2": (1, 256, 256, 4, 2),
           "T63-H512-I256-E8-K3": (63, 512, 256, 8, 3),
           "T130-H256-I512-E4-K2": (130, 256, 512, 4, 2),
           "T37-H256-I256-E9-K8": (37, 256, 256, 9, 8)}


def random_weights(rng, kind, shape, k, scale=0.01):
    """Random bytes (every bit pattern of the quants and the packed 6-bit scales and mins) with
    finite fp16 scales of about `scale`: rows [*shape, K/Q·S]; Q8_0 as (qs, d)."""
    if kind == "q8_0":
        d = (rng.uniform(0.5, 1.5, (*shape, k // 32)) * scale).astype(np.float16)
        return rng.integers(-128, 128, (*shape, k), dtype=np.int8), d
    fmt = kquant.FORMATS[kind]
    blocks = rng.integers(0, 256, (*shape, fmt.n_bytes(k)), dtype=np.uint8)
    view = kquant.block_view(fmt, blocks)
    for o in fmt.scale_offsets:
        d = (rng.uniform(0.5, 1.5, view.shape[:-1]) * scale).astype(np.float16)
        view[..., o:o + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    return blocks


def check(name, expected, actual):
    scale = float(np.abs(expected).max())
    assert_close(name, expected, actual, atol=GEMM_REL * scale, rtol=GEMM_REL)
    report_error(name, expected, actual)


@needs_gpu
@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("shape", DENSE.values(), ids=DENSE.keys())
def test_dense_matches_reference(rng, kind, shape):
    n_tokens, n, k = shape
    if k % kquant_gemm.FORMATS[kind].block_values:
        pytest.skip(f"{kind} rows are whole 256-blocks")
    blocks = random_weights(rng, kind, (n,), k)
    x = rng.standard_normal((n_tokens, k)).astype(np.float32)
    out = poisoned((n_tokens, n))
    assert kquant_gemm.gpu(kind, x, blocks, out=out) is out
    check(f"kquant_gemm {kind} dense y", kquant_gemm.reference(kind, x, blocks), out)


@needs_gpu
@pytest.mark.parametrize("kind", FORMATS)
def test_every_weight_is_dequantised_bit_for_bit(rng, kind):
    """x = I: each output is one weight times 1 plus zeros, so y = Wᵀ exactly: the in-register
    dequantisation equals llama.cpp's (ops/kquant.py dequantize), bit for bit, every byte
    pattern of the quants and the packed scales. (A weight of -0.0, q - 32 = 0 times a negative
    scale, comes out +0.0: the sum -0 + 0 is +0; the reference's zeros are compared as +0.)"""
    n, k = 200, 512
    blocks = random_weights(rng, kind, (n,), k)
    out = poisoned((k, n))
    kquant_gemm.gpu(kind, np.eye(k, dtype=np.float32), blocks, out=out)
    expected = kquant_gemm.dequantize(kind, blocks).T + np.float32(0)  # -0.0 -> +0.0
    np.testing.assert_array_equal(out.view(np.uint32), np.ascontiguousarray(expected)
                                  .view(np.uint32))


def expert_inputs(rng, gu_kind, dn_kind, n_tokens, hidden, n_inter, n_experts, top_k):
    x = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    ids = np.argsort(rng.random((n_tokens, n_experts)), axis=1)[:, :top_k].astype(np.int32)
    weights = rng.random((n_tokens, top_k)).astype(np.float32)
    weights /= weights.sum(axis=1, keepdims=True)
    # d ~ 0.03/sqrt(K): with random 6-bit scales (~32) weights of ~1/sqrt(K), outputs O(1).
    gate_up = random_weights(rng, gu_kind, (n_experts, 2 * n_inter), hidden,
                             0.03 / np.sqrt(hidden))
    down = random_weights(rng, dn_kind, (n_experts, hidden), n_inter, 0.03 / np.sqrt(n_inter))
    return x, ids, weights, gate_up, down


# A Q4_K_M file's pairs: gate_up Q4_K, down Q4_K or Q6_K (model/quant_mix.py), or their
# fallbacks for narrow rows (Q5_0, and Q8_0 for Q6_K); a Q5_K_M's (Q5_K, down Q5_K or Q6_K);
# and the others each way.
PAIRS = [("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q6_k", "q4_k"), ("q5_0", "q8_0"),
         ("q8_0", "q5_1"), ("q5_1", "q5_0"), ("q5_k", "q6_k"), ("q4_k", "q5_k")]


@needs_gpu
@pytest.mark.parametrize("kinds", PAIRS, ids=["-".join(p) for p in PAIRS])
@pytest.mark.parametrize("shape", EXPERTS.values(), ids=EXPERTS.keys())
def test_experts_match_reference(rng, kinds, shape):
    args = expert_inputs(rng, *kinds, *shape)
    expected = kquant_gemm.expert_reference(*kinds, *args)
    out = poisoned(expected.shape)
    assert kquant_gemm.experts_gpu(*kinds, *args, out=out) is out
    check(f"kquant_gemm {kinds[0]}/{kinds[1]} experts y", expected, out)


@needs_gpu
def test_expert_partial_row_tiles(rng):
    """Experts of 32, 33, 65, 1 and 69 slots (second row tiles of 1 and 5 rows): the rows past
    a tile's end load a clamped row and are never stored."""
    counts = np.array([32, 33, 65, 1, 69])
    slots = np.repeat(np.arange(counts.size, dtype=np.int32), counts)
    half = slots.size // 2
    ids = rng.permutation(np.stack([slots[:half], slots[half:]], axis=1))
    assert (ids[:, 0] != ids[:, 1]).all()
    args = list(expert_inputs(rng, "q4_k", "q6_k", len(ids), 256, 256, counts.size, 2))
    args[1] = ids
    expected = kquant_gemm.expert_reference("q4_k", "q6_k", *args)
    check("kquant_gemm experts y (partial tiles)", expected,
          kquant_gemm.experts_gpu("q4_k", "q6_k", *args, out=poisoned(expected.shape)))


@needs_gpu
def test_misaligned_q4_k_blocks_raise(rng):
    from fermijit.jit import gpu

    blocks = random_weights(rng, "q4_k", (4,), 256)
    base = gpu.to_device("test", "b", np.zeros(blocks.size + 16, np.uint8), np.uint8)
    with pytest.raises(FermijitError, match="boundary"):
        kquant_gemm.gpu("q4_k", np.zeros((2, 256), np.float32), base[8:8 + blocks.size]
                        .reshape(blocks.shape))


def test_every_imported_kind_has_a_kernel():
    """Every GGUF block kind ops/kquant.py imports (Q5_K the last, issue 34) has a FORMAT of
    kquant_gemm.ptx, and the template declares exactly GPU_FORMATS."""
    from fermijit.kernels_ptx import kquant_gemm as template

    assert set(kquant.FORMATS) <= set(kquant_gemm.GPU_FORMATS)
    assert template.PARAMS["FORMAT"][1] == kquant_gemm.GPU_FORMATS
    assert set(kquant_gemm.ALIGN) == set(kquant_gemm.GPU_FORMATS)


def test_kinds_without_a_kernel_are_refused():
    q2_k = kquant.Format("q2_k", 256, 84, (80, 82))         # a kind fermijit does not import
    blocks = np.zeros((4, q2_k.n_bytes(256)), np.uint8)
    with pytest.raises(FermijitError, match="no GPU kernel"):
        kquant_gemm.gpu(q2_k, np.zeros((2, 256), np.float32), blocks)


def test_activation_kinds_are_the_cpu_products():
    """Each kind's product rounds its input as ops/kquant_matvec.py's does on the CPU."""
    from fermijit.ops import kquant_matvec

    for name, fmt in kquant.FORMATS.items():
        assert (kquant_gemm.act_kind(name) == "q8_k") == kquant_matvec.is_k_quant(fmt), name
    assert kquant_gemm.act_kind("q4_0") == kquant_gemm.act_kind("q8_0") == "q8_0"
