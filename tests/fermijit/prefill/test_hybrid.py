"""The prefillers without a GPU (fermijit/prefill/hybrid.py): sizes, the memory plan (full-size
shapes within the C2075's 6 GB), the choice of device, and every fallback to the CPU (issue 10 items
2 and 4). The GPU runs themselves: tests/fermijit/prefill/test_hybrid_gpu.py."""

import io

import numpy as np
import pytest

from fermijit import FermijitError, engine
from fermijit.jit import gpu, gpu_early
from fermijit.model.forward import load_model
from fermijit.model.state import KvCache
from fermijit.prefill import gpu_layout, gpu_prefill, gpu_state, hybrid
from tests.fermijit.prefill.hybrid_models import empty_full_size

GIB = 1 << 30


@pytest.fixture(scope="module")
def default_model():
    return load_model(engine.DEFAULT_MODEL)[1]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: "pycuda is not installed (test)")


@pytest.mark.parametrize("text, expected", [("6G", 6 * GIB), ("512M", 512 << 20),
                                            ("1.5GiB", 3 * GIB // 2), ("4096", 4096),
                                            ("2k", 2048), (None, None)])
def test_sizes_parse(text, expected):
    assert hybrid.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["six", "6X", "-1G", ""])
def test_bad_sizes_are_one_line_errors(text):
    with pytest.raises(FermijitError, match="not a size"):
        hybrid.parse_bytes(text)


def test_plan_of_the_default_model(default_model):
    p = hybrid.plan(default_model, 947, 0, 6 * GIB, GIB)
    assert p.n_chunks == 1 and p.chunk == 947 and p.source == "pinned"
    assert p.total <= p.budget
    text = p.describe()
    for what in ("resident dense weights", "streamed per layer", "activations per pass"):
        assert what in text


def test_plan_chunks_the_largest_pass_that_fits(default_model):
    p = hybrid.plan(default_model, 947, 0, 40 << 20, GIB)
    assert 1 < p.n_chunks and p.chunk % hybrid.MIN_CHUNK == 0 and p.total <= p.budget
    more = p.chunk + hybrid.MIN_CHUNK  # one more tile row of tokens would not have fitted
    activations = hybrid.POOL_SLACK * (gpu_layout.activation_bytes(default_model, more)
                                       + 4 * default_model.vocab_size)
    assert p.total - p.activations + activations > p.budget


def test_plan_refuses_a_budget_nothing_fits(default_model):
    with pytest.raises(FermijitError, match="GPU memory"):
        hybrid.plan(default_model, 947, 0, 1 << 20, GIB)


def test_plan_past_the_pin_budget_uses_a_staging_ring(default_model):
    p = hybrid.plan(default_model, 100, 0, 6 * GIB, 4 << 20)   # the pool is 7.6 MiB
    assert p.source == "ring" and p.pinned <= 4 << 20


@pytest.mark.parametrize("name", ["qwen3.6-35b-a3b-reap128", "qwen3.6-35b-a3b"])
def test_full_size_shapes_plan_within_6g(name):
    """Issue 10 item 2: both full-size shapes plan within the C2075's 6 GB, 947 tokens in one
    pass (the GPU run of the same: bench prefill --gpu-mem 6G, /work/notes/hybrid.md)."""
    model = empty_full_size(name)
    p = hybrid.plan(model, 947, 0, 6 * GIB, 64 * GIB)
    assert p.n_chunks == 1 and p.total <= 6 * GIB
    n_experts = 128 if "reap" in name else 256
    assert p.streamed_per_layer == n_experts * 3 * 512 * 2048 * 18 // 32  # Q4_0: 18 B / 32
    long = hybrid.plan(model, 16384, 0, 6 * GIB, 64 * GIB)  # a long prompt runs in chunks
    assert long.n_chunks > 1 and long.total <= 6 * GIB


def prefill_both(model, prefiller, tokens):
    """(logits, state) of `prefiller` and of the CPU path on fresh states."""
    state, cpu_state = model.new_state(tokens.size + 1), model.new_state(tokens.size + 1)
    logits = prefiller.prefill(tokens, state)
    return logits, state, model.prefill(tokens, cpu_state), cpu_state


def assert_same_state(a, b):
    assert a.position == b.position
    for x, y in zip(a.layers, b.layers):
        for u, v in zip(x.arrays, y.arrays, strict=True):
            np.testing.assert_array_equal(u, v)


def test_without_a_gpu_prefill_falls_back_to_the_cpu_once(default_model, no_gpu):
    err = io.StringIO()
    pf = hybrid.make(default_model, "gpu", err=err)
    tokens = np.arange(1, 40, dtype=np.int32)
    logits, state, cpu_logits, cpu_state = prefill_both(default_model, pf, tokens)
    np.testing.assert_array_equal(logits, cpu_logits)
    assert_same_state(state, cpu_state)
    pf.prefill(tokens, default_model.new_state(tokens.size))
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and "prefilling on the CPU" in lines[0] and "pycuda" in lines[0]


@pytest.fixture
def broken_gpu(monkeypatch):
    """A GPU that is there, but preparing the prefill on it fails (a driver error)."""
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: None)
    monkeypatch.setattr(gpu, "memory", lambda: (8 * GIB, 8 * GIB))

    def broken(*args, **kwargs):
        raise RuntimeError("cuMemAlloc failed: out of memory")

    monkeypatch.setattr(gpu_prefill, "DeviceModel", broken)


def test_a_driver_error_while_preparing_falls_back(default_model, broken_gpu):
    err = io.StringIO()
    pf = hybrid.make(default_model, "gpu", err=err)
    assert not pf.prepare()
    tokens = np.arange(3, 30, dtype=np.int32)
    logits, state, cpu_logits, cpu_state = prefill_both(default_model, pf, tokens)
    np.testing.assert_array_equal(logits, cpu_logits)
    assert_same_state(state, cpu_state)
    assert err.getvalue().count("\n") == 1 and "out of memory" in err.getvalue()


def test_a_failure_during_the_pass_leaves_the_state_to_the_cpu(default_model, monkeypatch):
    """A GPU error after the state was read (here: its upload) must not touch the host state."""
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: None)
    monkeypatch.setattr(gpu, "memory", lambda: (8 * GIB, 8 * GIB))
    pf = hybrid.GpuPrefiller(default_model, err=io.StringIO())
    pf.device = object()  # prepared

    def fails(*args):
        raise MemoryError("device out of memory")

    monkeypatch.setattr(gpu_state, "upload_states", fails)
    tokens = np.arange(5, 50, dtype=np.int32)
    state = default_model.new_state(60)
    default_model.prefill(tokens[:7], state)     # a state part way, as a prefix cache gives
    cpu_state = state.copy()
    logits = pf.prefill(tokens[7:], state)
    np.testing.assert_array_equal(logits, default_model.prefill(tokens[7:], cpu_state))
    assert_same_state(state, cpu_state)
    assert pf.broken is not None and pf.device is None


def test_auto_is_quiet_without_a_gpu(default_model, no_gpu):
    """auto (the default) on a machine without a GPU: the CPU, and not a word about the GPU."""
    err = io.StringIO()
    pf = hybrid.make(default_model, "auto", err=err)
    assert not pf.prepare()
    for n in (hybrid.AUTO_MIN_TOKENS - 1, hybrid.AUTO_MIN_TOKENS):
        tokens = np.resize(np.arange(1, 50, dtype=np.int32), n)
        logits, state, cpu_logits, cpu_state = prefill_both(default_model, pf, tokens)
        np.testing.assert_array_equal(logits, cpu_logits)
        assert_same_state(state, cpu_state)
    assert pf.chunk_tokens == hybrid.CPU_CHUNK_TOKENS
    assert err.getvalue() == ""


def test_auto_says_why_a_gpu_it_has_is_not_used(default_model, broken_gpu):
    """A GPU that is there but fails to prepare is said once, as for --prefill gpu; short
    prompts never try it."""
    err = io.StringIO()
    pf = hybrid.make(default_model, "auto", err=err)
    prefill_both(default_model, pf, np.arange(1, hybrid.AUTO_MIN_TOKENS, dtype=np.int32))
    assert err.getvalue() == ""                   # the GPU was not even tried
    long = np.resize(np.arange(1, 50, dtype=np.int32), hybrid.AUTO_MIN_TOKENS)
    logits, _, cpu_logits, _ = prefill_both(default_model, pf, long)
    np.testing.assert_array_equal(logits, cpu_logits)
    prefill_both(default_model, pf, long)
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and "out of memory" in lines[0]


@pytest.mark.parametrize("mode", ["cpu", "gpu", "auto"])
def test_prefill_batch_is_each_prefill_alone(default_model, no_gpu, mode):
    """Every prefiller's prefill_batch: the logits in the items' order, each item's state and
    logits its `prefill` alone (bit for bit: without a GPU all run on the CPU), on_block per
    item summing to its tokens."""
    pf = hybrid.make(default_model, mode, err=io.StringIO())
    lengths = (40, 3, hybrid.AUTO_MIN_TOKENS, 1)
    prompts = [np.resize(np.arange(n + 5, 0, -1, dtype=np.int32), n) for n in lengths]
    fed = [[] for _ in prompts]
    items = [hybrid.PrefillItem(p, default_model.new_state(64), fed[k].append)
             for k, p in enumerate(prompts)]
    got = pf.prefill_batch(items, align=16)
    for k, (p, item) in enumerate(zip(prompts, items)):
        state = default_model.new_state(64)
        np.testing.assert_array_equal(got[k], default_model.prefill(p, state, align=16))
        assert_same_state(item.state, state)
        assert sum(fed[k]) == p.size


def test_an_unquantised_model_is_refused_by_the_plan(tmp_path):
    from tests.model import tiny

    _, model = load_model(tiny.write_checkpoint(tmp_path / "hf", model=tiny.HF_INIT))
    with pytest.raises(FermijitError, match="4-bit"):
        hybrid.plan(model, 10, 0, GIB, GIB)


def test_shapes_the_kernels_do_not_take_are_refused_by_the_plan(tmp_path):
    """HF_INIT's GDN key dim is 32; the chunked GDN kernels take 64 and 128."""
    from fermijit.model import convert
    from tests.model import tiny

    convert.convert(tiny.write_checkpoint(tmp_path / "hf", model=tiny.HF_INIT), tmp_path / "q4",
                    show_progress=False)
    with pytest.raises(FermijitError, match="linear key dim 32"):
        hybrid.plan(load_model(tmp_path / "q4")[1], 10, 0, GIB, GIB)


def test_bad_input_is_an_error_not_a_fallback(default_model, monkeypatch):
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: None)
    pf = hybrid.GpuPrefiller(default_model, err=io.StringIO())
    pf.device = object()
    for tokens in (np.array([], np.int32), np.array([1, default_model.vocab_size], np.int32)):
        with pytest.raises(FermijitError):
            pf.prefill(tokens, default_model.new_state(4))
    with pytest.raises(FermijitError, match="context full"):
        pf.prefill(np.ones(5, np.int32), default_model.new_state(4))
    assert pf.broken is None


def test_bad_mode_is_refused(default_model):
    with pytest.raises(FermijitError, match="--prefill"):
        hybrid.make(default_model, "tpu")


@pytest.mark.parametrize("shape", [(947, 8, 128), (3, 8, 128), (50, 4, 16), (1, 1, 8)])
def test_route_slots_is_expert_matmuls_sort(rng, shape):
    """gpu_layout.route_slots (vectorised) gives what expert_matmul.route uploads."""
    from fermijit.ops import expert_matmul

    t, k, e = shape
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    ids[: t // 3] = ids[0]                                  # some experts with many tokens
    weights = rng.random((t, k), dtype=np.float32)
    rows, slot_weights, tiles = gpu_layout.route_slots(ids, weights, e)
    order, _, expected_tiles = expert_matmul.sort_slots(ids, e)
    np.testing.assert_array_equal(tiles, expected_tiles)
    np.testing.assert_array_equal(rows, order // k)
    np.testing.assert_array_equal(slot_weights, weights.reshape(-1)[order])


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    from tests.fermijit.prefill.hybrid_models import tiny_e128

    return tiny_e128(tmp_path_factory.mktemp("hybrid-cli"))


def test_generate_with_gpu_prefill_streams_what_the_cpu_does(q4_model):
    """`generate --prefill gpu`: the same greedy text as the CPU path; without a GPU one line
    says why the CPU prefilled, with one the plan is printed (--verbose)."""
    from tests.fermijit.test_generate import PROMPT, expected, fermijit

    code, out, err = fermijit("generate", "--model", q4_model, PROMPT, "--max-tokens", 8,
                              "--temperature", 0, "--threads", 1, "--prefill", "gpu",
                              "--gpu-mem", "1G", "--verbose")
    assert code == 0, err
    assert out.rstrip("\n") == expected(q4_model, PROMPT, 8)[0]
    if gpu.unavailable_reason() is not None:
        assert "gpu prefill unavailable, prefilling on the CPU: no GPU" in err
    else:
        assert "gpu prefill ready" in err and "gpu prefill plan" in err


@pytest.mark.parametrize("flag", [("--gpu-mem", "lots"), ("--pin-budget", "-3G"),
                                  ("--prefill", "tpu")])
def test_bad_prefill_flags_are_one_line(q4_model, flag):
    from tests.fermijit.test_generate import fermijit

    for command in (("generate", PROMPT_TEXT), ("eval", "--text", __file__)):
        code, out, err = fermijit(*command, "--model", q4_model, *flag)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err


PROMPT_TEXT = "the cat sat"


def test_handed_arrays_are_what_the_hand_off_writes(default_model):
    state = default_model.new_state(300)
    state.position = 7
    for s, arrays in zip(state.layers, gpu_state.handed_arrays(state, 300)):
        assert all(a.flags.c_contiguous for a in arrays)
        if isinstance(s, KvCache):  # each head's rows from the position on: codes, scales
            heads, _, dim = s.k.shape
            assert [a.shape for a in arrays] == [(300 - 7, dim), (300 - 7, dim // 32)] * 2 * heads
            assert all(np.shares_memory(a, s.arrays[2 * (n >= 2 * heads) + n % 2])
                       for n, a in enumerate(arrays))
        else:
            assert len(arrays) == 2 and arrays[0] is s.conv and arrays[1] is s.recurrent


def test_a_q8_0_lm_head_goes_to_the_gpu_as_stored(default_model, rng):
    """No work on the host at start (issue 28 item 4: its split into two Q4_0 matrices took
    0.15-0.85 s): the head's own arrays, in the layout kquant_gemm's Q8_0 GEMM reads, whose
    product on x rounded as the GPU rounds it (act_quant) is the CPU's head to fp32 rounding."""
    from fermijit.model.forward import linear
    from fermijit.ops import act_quant, kquant_gemm

    w = default_model.lm_head
    head = gpu_layout.head_arrays(default_model)
    assert head.keys() == {"qs", "d"} and gpu_layout.head_kind(default_model) == "q8_0"
    assert np.shares_memory(head["qs"], w.qs) and np.shares_memory(head["d"], w.d)
    assert gpu_layout.head_bytes(default_model) == head["qs"].nbytes + head["d"].nbytes
    x = rng.standard_normal((3, default_model.hidden)).astype(np.float32)
    got = kquant_gemm.reference("q8_0", act_quant.reference(x)[2], (head["qs"], head["d"]))
    cpu = linear(x, w, np.full((3, default_model.vocab_size), np.nan, np.float32))
    np.testing.assert_allclose(got, cpu, rtol=1e-4, atol=1e-4 * np.abs(cpu).max())


def test_the_hand_off_writes_new_page_locked_gdn_states_in_place(monkeypatch, rng):
    """gpu_state.hand_off with a stand-in driver over fake device memory: a new state's
    (position 0) GDN arrays in page-locked memory (the server's pool) are the copies' own
    destinations, every other array comes through the hand-off buffer; all hold the device's
    values and the positions move to the end. A copy that fails leaves the new state's GDN
    arrays zeros again, the other state as it was, and the positions where they were."""
    import contextlib
    import types

    from fermijit.model.state import GdnState, State

    base, memory = 1 << 20, rng.standard_normal(1 << 14).astype(np.float32)
    used = [0]

    def device(shape):
        at = used[0]
        used[0] += int(np.prod(shape))
        return types.SimpleNamespace(gpudata=base + 4 * at, shape=shape)

    def values(d):
        at = (int(d.gpudata) - base) // 4
        return memory[at:at + int(np.prod(d.shape))].reshape(d.shape)

    class Cuda:
        Context = types.SimpleNamespace(synchronize=lambda: None)
        fail_at = None

        def __init__(self):
            self.dests = []

        def memcpy_dtoh_async(self, dest, src, stream):
            self.dests.append(dest)
            if len(self.dests) == self.fail_at:
                raise RuntimeError("an injected copy fault")
            out = dest.reshape(-1).view(np.uint8)
            out[...] = memory.view(np.uint8)[src - base:][:out.size]

    conv, rec, kv = (4, 3), (2, 4, 4), (2, 16, 8)
    block = np.zeros(4 * (12 + 32), np.uint8)         # "page-locked" (registered below)
    monkeypatch.setitem(gpu._pinned, block.ctypes.data, block.nbytes)
    pooled = GdnState(block[:48].view(np.float32).reshape(conv),
                      block[48:].view(np.float32).reshape(rec))
    seen = GdnState(rng.standard_normal(conv).astype(np.float32),
                    rng.standard_normal(rec).astype(np.float32))
    states = [State(0, [pooled, KvCache(np.zeros(kv, np.float32), np.zeros(kv, np.float32))]),
              State(3, [seen, KvCache(np.zeros(kv, np.float32), np.zeros(kv, np.float32))])]
    on_device = [[GdnState(device(conv), device(rec)), KvCache(device(kv), device(kv))]
                 for _ in states]
    dev = types.SimpleNamespace(host_buffer=lambda name, n: np.zeros(n, np.uint8),
                                readback=types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(gpu, "check", lambda *a, **k: contextlib.nullcontext())
    sequences = [(d, s, 10, None) for d, s in zip(on_device, states)]
    before = [a.copy() for a in seen.arrays]

    failing = Cuda()
    failing.fail_at = 12  # 4 + 6 staged (KV heads, the other GDN), then the pooled conv, rec
    monkeypatch.setattr(gpu, "driver", lambda: failing)
    with pytest.raises(RuntimeError, match="injected"):
        gpu_state.hand_off(dev, sequences)
    assert failing.dests[-2] is pooled.conv              # the first in place, landed, then
    assert not block.any()                               # zeroed again
    assert [s.position for s in states] == [0, 3]
    for a, b in zip(seen.arrays, before):
        np.testing.assert_array_equal(a, b)

    cuda = Cuda()
    monkeypatch.setattr(gpu, "driver", lambda: cuda)
    timings = {}
    gpu_state.hand_off(dev, sequences, timings)
    assert [s.position for s in states] == [10, 10]
    assert list(timings) == ["rounding", "copies", "host copy"]   # its steps (--verbose)
    assert all(t >= 0 for t in timings.values())
    direct = [d for d in cuda.dests if d.dtype == np.float32]
    assert len(direct) == 2 and direct[0] is pooled.conv and direct[1] is pooled.recurrent
    for d, s, start in zip(on_device, states, (0, 3)):
        for a, b in zip(s.layers[0].arrays, d[0].arrays):
            np.testing.assert_array_equal(a, values(b))
        for a, b in ((s.layers[1].k, d[1].k), (s.layers[1].v, d[1].v)):
            np.testing.assert_array_equal(a[:, start:10], values(b)[:, start:10])
            assert not a[:, :start].any()


def test_states_go_in_as_views_of_two_allocations(monkeypatch, rng, default_model):
    """gpu_state.upload_states with a stand-in driver over fake device memory (poisoned NaN): a
    sequence's device states are views of two allocations (its GDN states', its KV caches'),
    each array on its own DEVICE_ALIGN floats, none overlapping; a new state's GDN states are
    zeros (one memset), a held one's are its host arrays, and its KV rows its host rows
    (dequantised from Q8_0) for each head, the rest of the room unwritten."""
    import contextlib
    import types

    from fermijit.ops import kv_quant

    base, memory = 1 << 20, np.full(1 << 24, np.nan, np.float32)
    allocations = []

    class Dev:
        def __init__(self, shape, at):
            self.shape, self.at, self.dtype = tuple(shape), at, np.dtype(np.float32)
            self.size, self.gpudata = int(np.prod(shape)), base + 4 * at

        def __getitem__(self, rows):
            start, stop, step = rows.indices(self.size)
            assert step == 1 and len(self.shape) == 1
            return Dev((stop - start,), self.at + start)

        def reshape(self, shape):
            assert int(np.prod(shape)) == self.size
            return Dev(shape, self.at)

        def values(self):
            return memory[self.at:self.at + self.size].reshape(self.shape)

    def empty(shape, dtype=np.float32):
        at = sum(int(np.prod(s)) for s in allocations) + 7  # not aligned itself: the pool's is
        allocations.append(shape)
        return Dev(shape, at)

    class Cuda:
        n_memsets = 0

        def memset_d32(self, address, value, count):
            self.n_memsets += 1
            at = (int(address) - base) // 4
            memory.view(np.uint32)[at:at + count] = value

        def memcpy_htod(self, address, host):
            out = memory.view(np.uint8)[int(address) - base:][:host.nbytes]
            out[...] = np.ascontiguousarray(host).reshape(-1).view(np.uint8)

    cuda = Cuda()
    monkeypatch.setattr(gpu, "driver", lambda: cuda)
    monkeypatch.setattr(gpu, "empty", empty)
    monkeypatch.setattr(gpu, "check", lambda *a, **k: contextlib.nullcontext())

    def arrays(states):
        return ([a for s in states if isinstance(s, KvCache) for a in (s.k, s.v)],
                [a for s in states if not isinstance(s, KvCache) for a in (s.conv, s.recurrent)])

    new = default_model.new_state(40)
    held = default_model.new_state(40)
    for s in held.layers:
        if isinstance(s, KvCache):
            for a in (s.k, s.v):
                for h in range(a.shape[0]):
                    rows = rng.standard_normal((9, a.shape[2])).astype(np.float32)
                    a[h, :9] = kv_quant.reference(rows) if hasattr(a, "qs") else rows
        else:
            for a in s.arrays:
                a[...] = rng.standard_normal(a.shape)
    held.position = 9
    for state, n_memsets in ((new, 1), (held, 0)):
        del allocations[:]
        cuda.n_memsets = 0
        dev = gpu_state.upload_states(state, 30)
        assert len(allocations) == 2 and cuda.n_memsets == n_memsets
        kv, gdn = arrays(dev)
        host_kv, host_gdn = arrays(state.layers)
        spans = sorted((a.at, a.at + a.size) for a in kv + gdn)
        assert all(a.at % gpu_state.DEVICE_ALIGN == 7 for a in kv + gdn)
        assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))
        first_kv = min(a.at for a in kv)
        assert all(a.at < first_kv for a in gdn)              # two blocks: GDN's, then KV's
        for d, h in zip(gdn, host_gdn):
            assert d.shape == h.shape
            np.testing.assert_array_equal(d.values(), h if state.position else 0 * h)
        for d, h in zip(kv, host_kv):
            assert d.shape == (h.shape[0], 30, h.shape[2])
            got = d.values()
            for head in range(h.shape[0]):
                rows = h[head, :state.position]
                rows = rows.dequantize() if hasattr(rows, "dequantize") else rows
                np.testing.assert_array_equal(got[head, :state.position], rows)
            assert np.isnan(got[:, state.position:]).all()


def test_the_dense_weights_go_up_as_views_of_one_allocation(monkeypatch, default_model):
    """gpu_prefill.DeviceModel's dense weights, norm and LM head with a stand-in driver over fake
    device memory (poisoned 0xFF): gpu.upload makes ONE allocation, each array a view of it on its
    own UPLOAD_ALIGN bytes (none overlapping) holding the host array's bytes; the copies are
    queued on one stream (no GIL released: `_queue_htod`) but for pageable arrays larger than
    QUEUE_PAGEABLE_MAX, which go through memcpy_htod, and are awaited once (issue 28 item 4: an
    allocation and a GIL-releasing copy per array took 0.72-0.96 s of the server's start)."""
    import contextlib
    import types

    from fermijit.prefill import expert_stream

    memory = np.full(64 << 20, 0xFF, np.uint8)
    base = 1 << 32
    calls = {"alloc": 0, "queued": 0, "sync_copies": 0, "synchronize": 0}

    class Allocation(int):
        pass

    class Cuda:
        def mem_alloc(self, n):
            calls["alloc"] += 1
            assert n <= memory.size
            return Allocation(base)

        def memcpy_htod(self, address, host):
            calls["sync_copies"] += 1
            assert not gpu.is_page_locked(host) and host.nbytes > gpu.QUEUE_PAGEABLE_MAX
            memory[address - base:][:host.nbytes] = host.reshape(-1).view(np.uint8)

    def queue(address, host, stream):
        calls["queued"] += 1
        assert stream.synchronized == 0           # awaited after every copy was queued
        memory[address - base:][:host.nbytes] = host.reshape(-1).view(np.uint8)

    class Stream:
        handle, synchronized = 7, 0

        def synchronize(self):
            calls["synchronize"] += 1
            self.synchronized += 1

    class GPUArray:
        def __init__(self, shape, dtype, gpudata, base):
            self.shape, self.dtype, self.gpudata, self.base = shape, np.dtype(dtype), gpudata, base
            self.nbytes = int(np.prod(shape)) * self.dtype.itemsize

        def values(self):
            at = self.gpudata - base
            return memory[at:at + self.nbytes].view(self.dtype).reshape(self.shape)

    class Streamer:  # no experts streamed: only the dense weights' way up is under test
        def __init__(self, layers, source, ring_slot_bytes):
            self.layer_bytes, self.source = 1, source

        def rebind(self, i, w):
            return w

    monkeypatch.setattr(gpu, "driver", lambda: Cuda())
    monkeypatch.setattr(gpu, "check", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(gpu, "gpuarray", lambda: types.SimpleNamespace(GPUArray=GPUArray))
    monkeypatch.setattr(gpu, "copy_stream", lambda: Stream())
    monkeypatch.setattr(gpu, "_queue_htod", queue)
    monkeypatch.setattr(gpu, "empty", lambda shape, dtype=np.float32: None)
    monkeypatch.setattr(expert_stream, "Streamer", Streamer)
    monkeypatch.setattr(gpu, "QUEUE_PAGEABLE_MAX", 64 << 10)  # so both ways are taken
    before = default_model.layers, default_model.mtp
    try:
        dev = gpu_prefill.DeviceModel(default_model, "pinned")
    finally:
        default_model.layers, default_model.mtp = before
    host = gpu_layout.dense_arrays(default_model)
    pairs = ([(dev.layers[i][k], v) for i, a in enumerate(host) for k, v in a.items()]
             + [(dev.norm, default_model.norm)]
             + [(dev.head[k], v) for k, v in gpu_layout.head_arrays(default_model).items()])
    assert [k for a in dev.layers for k in a] == [k for a in host for k in a]
    assert calls["alloc"] == 1 and calls["synchronize"] == 1
    assert calls["queued"] + calls["sync_copies"] == len(pairs)
    assert calls["sync_copies"] > 0 and calls["queued"] > 0
    spans = sorted((d.gpudata, d.gpudata + d.nbytes) for d, _ in pairs)
    assert all(a % gpu.UPLOAD_ALIGN == 0 for a, _ in spans)
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))
    for d, h in pairs:
        assert d.shape == h.shape and d.dtype == h.dtype
        np.testing.assert_array_equal(d.values(), h)
    assert dev.resident_bytes == sum(h.nbytes for _, h in pairs)


def test_the_hand_off_rounds_each_sequences_kv_caches_in_one_launch(monkeypatch, rng,
                                                                      default_model):
    """gpu_state.upload_states then hand_off with a stand-in driver over fake device memory
    (poisoned 0xFF), the rounding to Q8_0 a stand-in for act_quant.gpu running its numpy
    reference (the kernel's own test holds it to that): the Q8_0 KV caches of each sequence are
    rounded in ONE launch over its KV block (issue 28 item 5: ~20 a sequence took 0.03-0.12 s of
    an 8-prompt batch's hand-off), and each head's new rows arrive as act_quant.reference's
    codes and scales of the rows the pass wrote; the rows held before are untouched."""
    import contextlib

    from fermijit.ops import act_quant

    memory, base, used = np.full(1 << 26, 0xFF, np.uint8), 1 << 32, [0]

    class Dev:
        def __init__(self, shape, at, dtype=np.float32):
            self.shape, self.at, self.dtype = tuple(shape), at, np.dtype(dtype)
            self.size = int(np.prod(shape))
            self.nbytes, self.gpudata = self.size * self.dtype.itemsize, base + at

        def __getitem__(self, rows):
            start, stop, step = rows.indices(self.size)
            assert step == 1 and len(self.shape) == 1
            return Dev((stop - start,), self.at + start * self.dtype.itemsize, self.dtype)

        def reshape(self, shape):
            assert int(np.prod(shape)) == self.size
            return Dev(shape, self.at, self.dtype)

        def values(self):
            return memory[self.at:self.at + self.nbytes].view(self.dtype).reshape(self.shape)

    def empty(shape, dtype=np.float32):
        at = used[0]
        used[0] += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 256) * 256
        return Dev(shape, at, dtype)

    launches = []

    def rounding(x, out=None, codes=False):
        assert out is x and codes and len(x.shape) == 1
        launches.append(x.size)
        q, d, y = act_quant.reference(x.values())
        x.values()[...] = y
        on_device = empty(q.shape, np.int8), empty(d.shape)
        for a, v in zip(on_device, (q, d)):
            a.values()[...] = v
        return (x, *on_device)

    class Cuda:
        Context = type("Context", (), {"synchronize": staticmethod(lambda: None)})

        def memset_d32(self, address, value, count):
            memory[address - base:][:4 * count].view(np.uint32)[...] = value

        def memcpy_htod(self, address, host):
            out = memory[address - base:][:host.nbytes]
            out[...] = np.ascontiguousarray(host).view(np.uint8).reshape(-1)

        def memcpy_dtoh_async(self, dest, src, stream):
            out = dest.reshape(-1).view(np.uint8)
            out[...] = memory[src - base:][:out.size]

    monkeypatch.setattr(gpu, "driver", lambda: Cuda())
    monkeypatch.setattr(gpu, "empty", empty)
    monkeypatch.setattr(gpu, "check", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(act_quant, "gpu", rounding)
    states = [default_model.new_state(40), default_model.new_state(40)]
    held = states[1]
    for s in held.layers:
        if isinstance(s, KvCache):
            for a in (s.k, s.v):
                assert hasattr(a, "qs")  # the default kind: Q8_0 rows
                a[:, :9] = kv_quant_rows(rng, (a.shape[0], 9, a.shape[2]))
    held.position = 9
    before = [[a.copy() for s in st.layers if isinstance(s, KvCache) for a in (s.k, s.v)]
              for st in states]
    ends = [12, 30]
    on_device = [gpu_state.upload_states(st, end) for st, end in zip(states, ends)]
    written = []  # the pass's rows per sequence: fp32 [heads, positions, dim] of each cache
    for dev_states, st, end in zip(on_device, states, ends):
        assert dev_states.kv_block is not None
        rows = []
        for d in dev_states:
            if isinstance(d, KvCache):
                for x in (d.k, d.v):
                    v = x.values()
                    v[:, st.position:end] = rng.standard_normal(v[:, st.position:end].shape)
                    rows.append(v.copy())
        written.append(rows)
    dev = types_namespace(host_buffer=lambda name, n: np.zeros(n, np.uint8),
                          readback=types_namespace(synchronize=lambda: None))
    starts = [st.position for st in states]
    gpu_state.hand_off(dev, [(d, st, end, None) for d, st, end in zip(on_device, states, ends)])
    assert len(launches) == 2                              # one per sequence
    for st, start, end, rows, old in zip(states, starts, ends, written, before):
        assert st.position == end
        caches = [a for s in st.layers if isinstance(s, KvCache) for a in (s.k, s.v)]
        assert len(caches) == len(rows) > 2
        for a, r, o in zip(caches, rows, old):
            q, d, _ = act_quant.reference(r[:, start:end])
            np.testing.assert_array_equal(a.qs[:, start:end], q)
            np.testing.assert_array_equal(a.d[:, start:end], d)
            np.testing.assert_array_equal(a.qs[:, :start], o.qs[:, :start])
            np.testing.assert_array_equal(a.d[:, :start], o.d[:, :start])


def kv_quant_rows(rng, shape):
    from fermijit.ops import kv_quant

    return kv_quant.reference(rng.standard_normal(shape).astype(np.float32))


def types_namespace(**kw):
    import types

    return types.SimpleNamespace(**kw)


@pytest.mark.parametrize("n_threads", [1, 3])
def test_the_model_file_is_registered_in_chunks_and_copies_cut_at_their_ends(monkeypatch,
                                                                               tmp_path, rng,
                                                                               n_threads):
    """expert_stream._register_in_place registers a file mapping in page-aligned
    REGISTER_CHUNK_BYTES chunks covering it whole (pinning 11 GB at once held the memory-map lock
    ~0.6 s, stalling the kernel warm-up's mmaps beside it), on REGISTER_THREADS threads (each
    popping the context it pushed before it ends), with a stand-in for gpu.register (the
    driver's bookkeeping: gpu._registered); gpu.split_at_registrations cuts a range at each
    chunk's end, every piece inside one chunk and the pieces the range in order; a range across
    chunks is page-locked, one past the file is not; a refusal midway registers nothing."""
    import mmap
    import threading

    from fermijit.prefill import expert_stream

    pushed, released = set(), []
    monkeypatch.setenv(gpu_early.REGISTER_THREADS_ENV, str(n_threads))
    monkeypatch.setattr(gpu, "driver", lambda: pushed.add(threading.get_ident()))
    monkeypatch.setattr(gpu, "release_thread",
                        lambda: released.append(threading.current_thread().name))

    page = mmap.PAGESIZE
    path = tmp_path / "weights"
    data = rng.integers(0, 256, 10 * page + 123, dtype=np.uint8)
    data.tofile(path)
    root = np.memmap(path, np.uint8, "r")
    arrays = [(root[100:3 * page], root[5 * page + 7:])]   # two "expert" views of the file
    calls = []

    def register(address, nbytes):
        calls.append((address, nbytes))
        held = gpu.Registered(address, nbytes)
        gpu._registered[(address, nbytes)] = held
        return held

    monkeypatch.setattr(gpu, "register", register)
    monkeypatch.setattr(gpu, "_registered", __import__("weakref").WeakValueDictionary())
    monkeypatch.setattr(gpu_early, "REGISTER_CHUNK_BYTES", 3 * page)
    held = expert_stream._register_in_place(arrays)
    first = root.ctypes.data // page * page
    last = -(-(root.ctypes.data + root.nbytes) // page) * page
    assert [r.address for r in held] == sorted(a for a, _ in calls)  # in the file's order
    calls.sort()
    if n_threads > 1:
        assert sorted(released) == [f"fermijit-register-{n}" for n in range(n_threads)]
        assert len(pushed) <= n_threads + 1
    assert len(held) == len(calls) == -(-(last - first) // (3 * page)) > 2
    assert calls[0][0] == first and calls[-1][0] + calls[-1][1] == last
    assert all(a % page == 0 and n <= 3 * page for a, n in calls)
    assert all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:]))
    for a in (root[1:], root[page + 5:7 * page + 1], arrays[0][0], root[:10]):
        pieces = gpu.split_at_registrations(a)
        assert gpu.is_page_locked(a)
        assert np.array_equal(np.concatenate([p for _, p in pieces]), a)
        assert [at for at, _ in pieces] == list(np.cumsum([0] + [p.nbytes for _, p in pieces])[:-1])
        for _, p in pieces:
            assert sum(s <= p.ctypes.data and p.ctypes.data + p.nbytes <= s + n
                       for s, n in calls) == 1
    assert len(gpu.split_at_registrations(root[page + 5:7 * page + 1])) == 3
    assert not gpu.is_page_locked(np.zeros(10, np.uint8))

    del held
    refused = []

    def refuse_third(address, nbytes):
        if len(refused) == 2:
            return None
        refused.append(register(address, nbytes))
        return refused[-1]

    monkeypatch.setattr(gpu, "register", refuse_third)
    assert expert_stream._register_in_place(arrays) is None
    refused.clear()
    import gc

    gc.collect()
    assert not gpu._registered       # the chunks registered before the refusal let go


def test_an_upload_from_registered_chunks_is_cut_at_their_ends(monkeypatch, rng):
    """gpu.upload of a page-locked array across two registered chunks (stand-ins): two queued
    copies, each from one chunk, to the right device offsets."""
    import contextlib
    import types
    import weakref

    memory = np.full(1 << 16, 0xFF, np.uint8)
    base = 1 << 32
    host = rng.integers(0, 256, 5000, dtype=np.uint8)
    at = host.ctypes.data
    monkeypatch.setattr(gpu, "_registered", weakref.WeakValueDictionary())
    chunks = [gpu.Registered(at - 8, 2008), gpu.Registered(at + 2000, 4000)]
    for c in chunks:
        gpu._registered[(c.address, c.nbytes)] = c
    queued = []

    def queue(address, piece, stream):
        start = piece.ctypes.data
        if np.shares_memory(piece, host):  # from the chunks: from one of them
            assert sum(c.address <= start and start + piece.nbytes <= c.address + c.nbytes
                       for c in chunks) == 1
        queued.append(piece.nbytes)
        memory[address - base:][:piece.nbytes] = piece.reshape(-1).view(np.uint8)

    class GPUArray:
        def __init__(self, shape, dtype, gpudata, base):
            self.gpudata = gpudata

    monkeypatch.setattr(gpu, "driver", lambda: types.SimpleNamespace(mem_alloc=lambda n: base))
    monkeypatch.setattr(gpu, "check", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(gpu, "gpuarray", lambda: types.SimpleNamespace(GPUArray=GPUArray))
    monkeypatch.setattr(gpu, "copy_stream", lambda: types.SimpleNamespace(
        handle=1, synchronize=lambda: None))
    monkeypatch.setattr(gpu, "_queue_htod", queue)
    small = np.arange(3, dtype=np.float32)
    out = gpu.upload("test", [small, host])
    assert queued == [small.nbytes, 2000, 3000]
    assert out[1].gpudata == base + gpu.UPLOAD_ALIGN
    np.testing.assert_array_equal(memory[gpu.UPLOAD_ALIGN:][:host.size], host)


def test_the_streamer_copies_experts_from_registered_chunks(monkeypatch, tmp_path, rng):
    """expert_stream.Streamer on "mapped" experts (views of a file, registered in chunks by a
    stand-in driver): the experts asked for land in the layer buffer at the layout's offsets,
    each copy read from one registered chunk (those across a chunk's end cut there), no other
    byte of the buffer written; a view over some layers (`subset`, DeviceModel.sample's) copies
    the layer it names at its index."""
    import contextlib
    import mmap
    import types
    import weakref

    from fermijit.prefill import expert_stream

    page, E = mmap.PAGESIZE, 8
    path = tmp_path / "weights"
    rng.integers(0, 256, 6 * page + 77, dtype=np.uint8).tofile(path)
    root = np.memmap(path, np.uint8, "r")
    layers = [tuple(root[at:at + E * n].reshape(E, n) for at, n in pair)
              for pair in (((13, 1000), (9000, 300)), ((17000, 800), (24000, 8)))]
    monkeypatch.setattr(expert_stream, "expert_arrays", lambda w: w)
    monkeypatch.setattr(gpu_early, "REGISTER_CHUNK_BYTES", page)
    monkeypatch.setattr(gpu, "_registered", weakref.WeakValueDictionary())
    chunks = []

    def register(address, nbytes):
        chunks.append(gpu.Registered(address, nbytes))
        gpu._registered[(address, nbytes)] = chunks[-1]
        return chunks[-1]

    memory = np.zeros(1 << 16, np.uint8)
    base = 1 << 32

    def copy(address, src, stream):
        start = src.ctypes.data
        assert sum(c.address <= start and start + src.nbytes <= c.address + c.nbytes
                   for c in chunks) == 1
        memory[address - base:][:src.nbytes] = src.reshape(-1).view(np.uint8)

    monkeypatch.setattr(gpu, "register", register)
    monkeypatch.setattr(gpu, "copy_stream", lambda: None)
    monkeypatch.setattr(gpu, "check", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(gpu, "event", lambda: types.SimpleNamespace(record=lambda s=None: None))
    monkeypatch.setattr(gpu, "driver", lambda: types.SimpleNamespace(memcpy_htod_async=copy))
    streamer = expert_stream.Streamer(layers, "mapped")
    assert streamer.source == "mapped" and len(chunks) > 4
    for layer, arrays in enumerate(layers):
        memory[...] = 0
        wanted = rng.random(E) < 0.5
        wanted[[0, -1]] = True
        streamer.copy(layer, wanted, base)
        lay = streamer.layouts[layer]
        expected = np.zeros_like(memory)
        for start, a in zip(lay.offsets, arrays):
            region = expected[start:start + a.nbytes].reshape(a.shape)
            region[wanted] = a[wanted]
        np.testing.assert_array_equal(memory, expected)
    view = streamer.subset([1])
    memory[...] = 0
    view.copy(0, np.ones(E, bool), base)
    expected = np.zeros_like(memory)
    for start, a in zip(streamer.layouts[1].offsets, layers[1]):
        expected[start:start + a.nbytes] = a.reshape(-1)
    np.testing.assert_array_equal(memory, expected)
    assert view.stream is streamer.stream and len(streamer.layouts) == 2


def test_the_starts_gpu_pass_takes_the_first_layer_of_each_kind():
    """gpu_prefill.warm_layers: a layer per (mixer, GEMM kinds): the first GDN and attention
    layers where every layer's kinds are the same; a K-quant mix's layers whose down projections
    are another format count as another kind."""
    attention = (False, False, False, True) * 3
    q4 = {"in_proj_qkv": "q4_0", "gate_up": "q4_0", "down": "q4_0"}
    assert gpu_prefill.warm_layers(attention, [q4] * 12) == [0, 3]
    q6_down = [{**q4, "down": "q6_k"} if i % 3 == 1 else q4 for i in range(12)]
    assert gpu_prefill.warm_layers(attention, q6_down) == [0, 1, 3, 7]
    assert gpu_prefill.warm_layers(attention, q6_down + [{"fc": "q4_0"}]) == [0, 1, 3, 7]
