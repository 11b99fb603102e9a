"""The server's pool of resident GDN states (fermijit/server/state_pool.py, issue 28 item 5): new
states get zeroed arrays that ended ones gave back, never arrays a live state has; through the
scheduler, answers stay what each prompt gets alone, and a prefill that fails after writing into
its state's arrays gives nothing back to the pool."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fermijit.model.state import GdnState
from fermijit.server.state_pool import GdnPool
from tests.fermijit.server.test_prefill_chunks import (  # noqa: F401 - fixtures: alone, prompts
    BesidePrefiller, alone, at_once, complete, prompts, serving, text)


def gdn(state) -> list[np.ndarray]:
    return [a for s in state.layers if isinstance(s, GdnState) for a in (s.conv, s.recurrent)]


def scribble(state, rng) -> None:
    """A sequence's work: every GDN array written."""
    for a in gdn(state):
        a[...] = rng.standard_normal(a.shape)


def assert_no_sharing(states) -> None:
    for x, y in itertools.combinations(states, 2):
        for a in gdn(x):
            assert not any(np.shares_memory(a, b) for b in gdn(y))


@pytest.fixture
def model(engine):
    return engine.model


def test_fill_makes_zeroed_resident_states_up_to_capacity(model):
    pool = GdnPool(model, capacity=2)
    n = pool.n_layers
    assert n == sum(not a for a in model.is_attention) > 0
    pool.fill(1)
    assert len(pool.free) == n
    pool.fill(5)                                             # capped at capacity
    assert len(pool.free) == 2 * n
    assert all(not a.any() for s in pool.free for a in s.arrays)
    state = model.new_state(16)
    assert [a.shape for a in gdn(state)] == [a.shape for s in pool.free[:n] for a in s.arrays]


def test_fill_puts_each_states_arrays_in_one_block_of_the_allocator(model):
    """The GPU prefiller's page-locked memory (GpuPrefiller.host_memory) as the allocator: one
    block per state, poisoned here, zeroed by the pool; its views come back from `give`."""
    blocks = []

    def allocate(nbytes):
        blocks.append(np.full(nbytes, 0xA5, np.uint8))
        return blocks[-1]

    pool = GdnPool(model, capacity=2)
    pool.fill(2, allocate)
    n = pool.n_layers
    assert len(blocks) == 2 and not any(b.any() for b in blocks)
    for k, block in enumerate(blocks):
        assert all(np.shares_memory(a, block) for s in pool.free[k * n:(k + 1) * n]
                   for a in s.arrays)
    state = model.new_state(8)
    pool.take(state)
    pool.take(other := model.new_state(8))
    assert_no_sharing([state, other])
    pool.give(state)
    pool.give(other)
    pool.wait()
    assert len(pool.free) == 2 * n


def test_without_a_gpu_the_prefillers_host_memory_is_ordinary(model):
    from fermijit.jit import gpu
    from fermijit.prefill import hybrid

    pf = hybrid.make(model, "auto")
    if pf.prepare():
        pytest.skip("a GPU is usable here")
    a = pf.host_memory(1 << 20)
    assert a.dtype == np.uint8 and a.nbytes == 1 << 20 and not gpu.is_pinned(a)


def test_a_new_state_takes_the_pools_arrays_and_an_ended_one_gives_them_back_zeroed(model, rng):
    pool = GdnPool(model, capacity=1)
    pool.fill(1)
    pooled = [a for s in pool.free for a in s.arrays]
    state = model.new_state(16)
    pool.take(state)
    assert not pool.free
    mine = gdn(state)
    assert all(any(a is b for b in pooled) for a in mine)
    assert all(not a.any() for a in mine)
    scribble(state, rng)
    pool.give(state)
    assert state.layers == []                                # the ended state holds nothing
    pool.give(state)                                         # twice: nothing more
    pool.wait()
    assert len(pool.free) == pool.n_layers
    again = model.new_state(16)
    pool.take(again)
    assert all(any(a is b for b in mine) for a in gdn(again))
    assert all(not a.any() for a in gdn(again))              # zeroed, not the scribbles


def test_a_new_state_is_made_with_the_pools_arrays(model, monkeypatch):
    """Model.new_state(gdn=pool.take_one) (the scheduler's, through PromptPrefill): the pool's
    zeroed GDN states, without making zeros to throw away; where the pool runs out, new zeros."""
    import fermijit.model.state as state_module

    pool = GdnPool(model, capacity=1)
    pool.fill(1)
    pooled = [a for s in pool.free for a in s.arrays]
    made = []
    real_zeros = np.zeros
    monkeypatch.setattr(state_module.np, "zeros",
                        lambda *a, **k: made.append(a[0]) or real_zeros(*a, **k))
    state = model.new_state(16, gdn=pool.take_one)
    gdn_shapes = set(pool.shapes)
    assert not [shape for shape in made if tuple(shape) in gdn_shapes]
    assert all(any(a is b for b in pooled) for a in gdn(state)) and pool.free == []
    assert all(not a.any() for a in gdn(state))
    other = model.new_state(16, gdn=pool.take_one)            # the pool is empty: zeros
    assert all(not a.any() and not any(np.shares_memory(a, b) for b in pooled)
               for a in gdn(other))
    assert len(gdn(other)) == len(gdn(state))


def test_live_states_never_share_arrays(model, rng):
    """A pool of one state's worth and three new states, then states ending and new ones
    starting in turn: no two live states ever hold the same memory."""
    pool = GdnPool(model, capacity=2)
    pool.fill(1)
    live = [model.new_state(8) for _ in range(3)]
    for s in live:
        pool.take(s)
    assert_no_sharing(live)
    for _ in range(4):
        scribble(live[0], rng)
        pool.give(live.pop(0))
        pool.wait()
        live.append(model.new_state(8))
        pool.take(live[-1])
        assert all(not a.any() for a in gdn(live[-1]))
        assert_no_sharing(live)
    assert len(pool.free) <= pool.capacity


def test_a_restored_state_keeps_its_arrays_and_foreign_arrays_stay_out(model, rng):
    pool = GdnPool(model, capacity=2)
    pool.fill(1)
    restored = model.new_state(8)
    scribble(restored, rng)
    restored.position = 5                                     # as the prefix cache gives it
    before = gdn(restored)
    pool.take(restored)
    assert all(a is b for a, b in zip(gdn(restored), before))
    assert len(pool.free) == pool.n_layers
    viewed = model.new_state(8)                               # arrays that are views: not kept
    viewed.layers = [GdnState(s.conv[:], s.recurrent[:]) if isinstance(s, GdnState) else s
                     for s in viewed.layers]
    pool.give(viewed)
    pool.wait()
    assert len(pool.free) == pool.n_layers


class Reserving(BesidePrefiller):
    """Stands in for the GPU's prefiller: one with `reserve`, so the scheduler fills its pool."""

    def reserve(self, n_sequences):
        pass


@pytest.fixture(scope="module")
def more(engine, prompts):  # noqa: F811
    """Other prompts (no prefix in common with `prompts`) and their answers alone."""
    more = [np.roll(p, 1) + 1 for p in prompts]
    with serving(engine) as (url, _):
        return more, [text(complete(url, p)) for p in more]


def started_pool(scheduler):
    """The pool the scheduler's thread makes as it starts (in place of the empty one it begins
    with; on the GPU machine the tests had read, or patched, that one before it was replaced)."""
    import time

    for _ in range(1000):
        if scheduler.gdn_pool.capacity > 0:
            break
        time.sleep(0.01)
    assert scheduler.gdn_pool.capacity > 0, "the scheduler made no pool"
    return scheduler.gdn_pool


def test_batches_on_recycled_states_answer_as_alone(engine, prompts, alone, more):  # noqa: F811
    """Through the scheduler with a pool (filled at start, as with the GPU): a batch on the
    pool's first arrays, then one on the arrays the first gave back: each answer is the prompt's
    alone, and the pool ends holding zeros only."""
    with serving(engine, Reserving(engine.model)) as (url, scheduler):
        pool = started_pool(scheduler)
        assert [text(r) for r in at_once(url, prompts)] == alone
        assert [text(r) for r in at_once(url, more[0])] == more[1]
        pool.wait()
        assert pool.free and all(not a.any() for s in pool.free for a in s.arrays)


def test_a_state_is_given_back_as_its_sequence_ends_after_its_snapshots(
        engine, prompts, monkeypatch):  # noqa: F811
    """`_finish` gives an ended sequence's GDN states to the pool at once (zeroed while the
    others ending in that step snapshot theirs), after every snapshot of it: one that ends at its
    first token (max_tokens 1: in `_prefilled`) only once its prompt is snapshotted, so the same
    prompt again, restored from that snapshot, answers as before."""
    import time

    given, snapshotted = [], []
    with serving(engine, Reserving(engine.model)) as (url, scheduler):
        pool, cache = started_pool(scheduler), scheduler.engine.cache
        give, add = pool.give, cache.add
        monkeypatch.setattr(pool, "give", lambda state: (given.append(
            (len(snapshotted), len(state.layers))), give(state)))
        monkeypatch.setattr(cache, "add", lambda *a, **k: (snapshotted.append(a[1].position),
                                                           add(*a, **k)))
        first = complete(url, prompts[0], max_tokens=1)
        for _ in range(500):                                  # given after its Finished
            if given:
                break
            time.sleep(0.01)
        assert given and given[0][1] > 0                      # a state with its layers
        assert given[0][0] == len(snapshotted) >= 1           # after its prompt's snapshot
        again = complete(url, prompts[0], max_tokens=1)
        assert text(again) == text(first)
        given.clear()
        snapshotted.clear()
        complete(url, prompts[1])                # ends in a decode step: given before Finished
        assert len(given) == 1 and given[0][1] > 0
        assert given[0][0] == len(snapshotted) >= 2            # its prompt's, then its answer's
        assert scheduler._ended == [] and not scheduler._is_deferring


def test_a_prefill_that_fails_after_writing_its_states_returns_nothing_dirty(
        engine, prompts, alone, more):  # noqa: F811
    """A GPU-side failure after the hand-off began writing (the states' arrays scribbled, then
    an exception): the prompts retry on the CPU from fresh states and answer as alone; the
    scribbled arrays never come back to the pool, so later prompts answer as alone too."""
    class Scribbling(Reserving):
        n_raised = 0

        def prefill_batch(self, items, align=None):
            if self.n_raised == 0:
                self.n_raised += 1
                for item in items:
                    for a in gdn(item.state):
                        a.fill(np.float32(3.0))
                raise RuntimeError("cuMemcpyDtoH failed: an illegal memory access (test)")
            return super().prefill_batch(items, align)

    with serving(engine, Scribbling(engine.model)) as (url, scheduler):
        assert [text(r) for r in at_once(url, prompts)] == alone
        assert scheduler.n_prefill_failures == 1
        scheduler.gdn_pool.wait()
        assert all(not a.any() for s in scheduler.gdn_pool.free for a in s.arrays)
        assert [text(r) for r in at_once(url, more[0])] == more[1]


def test_each_array_starts_on_a_cache_line(model):
    from fermijit.server.state_pool import ALIGN

    pool = GdnPool(model, capacity=1)
    pool.fill(1, lambda n: np.empty(n + 3, np.uint8)[3:])    # a block that starts misaligned
    assert all(a.ctypes.data % ALIGN == 0 for s in pool.free for a in s.arrays)


def test_a_state_taken_while_others_are_zeroed_waits_for_their_zeros(model, rng, monkeypatch):
    """`give` leaves the zeroing to the pool's threads (slowed down here): a state taken
    meanwhile waits for them and gets those arrays zeroed, never fresh ones (their page faults
    in the GPU's hand-off: a second batch's "state out" 4x the first's on the H200) nor ones
    still being zeroed."""
    import time

    pool = GdnPool(model, capacity=2)
    pool.fill(1)

    def slow(s):
        time.sleep(0.1)
        GdnPool._zero(s)

    monkeypatch.setattr(pool, "_zero", slow)
    ended = model.new_state(8)
    pool.take(ended)
    mine = gdn(ended)
    scribble(ended, rng)
    pool.give(ended)
    time.sleep(0.02)                                          # the threads are zeroing
    new = model.new_state(8)
    pool.take(new)
    assert all(not a.any() for a in gdn(new))
    assert all(any(a is b for b in mine) for a in gdn(new))   # the pool's, not fresh
    pool.wait()
    assert pool.free == []


def test_take_waits_only_for_states_being_zeroed(model, monkeypatch):
    """An empty pool with nothing being zeroed: `take` leaves the state's own (fresh) arrays at
    once, however long it would wait for a zeroed one."""
    import time

    from fermijit.server import state_pool

    monkeypatch.setattr(state_pool, "TAKE_WAIT_S", 30.0)
    pool = GdnPool(model, capacity=1)
    pool.fill(1)
    pool.take(model.new_state(8))
    state = model.new_state(8)
    before = gdn(state)
    start = time.perf_counter()
    pool.take(state)
    assert time.perf_counter() - start < 5.0
    assert all(a is b for a, b in zip(gdn(state), before))


def test_given_back_states_are_zeroed_on_several_threads(model, rng, monkeypatch):
    """Two states given back together (a batch ending): their layers zeroed concurrently."""
    import threading
    import time

    from fermijit.server.state_pool import ZERO_THREADS

    pool = GdnPool(model, capacity=2)
    pool.fill(2)
    lock, now, most = threading.Lock(), [0], [0]

    def slow(s):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.05)
        with lock:
            now[0] -= 1
        GdnPool._zero(s)

    monkeypatch.setattr(pool, "_zero", slow)
    states = [model.new_state(8) for _ in range(2)]
    for s in states:
        pool.take(s)
        scribble(s, rng)
    for s in states:
        pool.give(s)
    pool.wait()
    assert most[0] == min(ZERO_THREADS, 2 * pool.n_layers) > 1
    assert len(pool.free) == 2 * pool.n_layers
    assert all(not a.any() for s in pool.free for a in s.arrays)


def test_a_cpu_server_pools_nothing(engine, prompts, alone):  # noqa: F811
    """Without a GPU prefill (no `reserve`), ended states are left to the garbage collector as
    before: the pool holds nothing."""
    with serving(engine) as (url, scheduler):
        assert [text(r) for r in at_once(url, prompts)] == alone
        scheduler.gdn_pool.wait()
        assert scheduler.gdn_pool.free == [] and scheduler.gdn_pool.capacity == 0


class Locking(Reserving):
    """As `Reserving`, counting its calls and handing out its own "page-locked" blocks."""

    def __init__(self, model):
        super().__init__(model)
        self.reserved, self.blocks = [], []

    def reserve(self, n_sequences):
        self.reserved.append(n_sequences)

    def host_memory(self, nbytes):
        self.blocks.append(np.full(nbytes, 0xFF, np.uint8))  # poisoned: fill zeroes it
        return self.blocks[-1]


def test_ready_to_serve_makes_the_room_and_the_pool_before_the_scheduler_starts(engine):
    """scheduler.ready_to_serve (serve calls it on the GPU's thread as it starts): the prefiller's
    room for a batch and a pool of max_batch states in its memory, zeroed; a scheduler given it
    neither reserves nor fills again (the first request waited for them, ~1 GB page-locked at
    full size); nothing for the CPU's prefiller."""
    from fermijit.prefill.hybrid import CpuPrefiller
    from fermijit.server.scheduler import Scheduler, ready_to_serve

    assert ready_to_serve(CpuPrefiller(engine.model), engine.model, 4) is None
    prefiller = Locking(engine.model)
    pool = ready_to_serve(prefiller, engine.model, 3)
    assert prefiller.reserved == [3] and len(prefiller.blocks) == 3
    assert len(pool.free) == 3 * pool.n_layers
    assert all(not a.any() for s in pool.free for a in s.arrays)
    blocks = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in prefiller.blocks]
    assert all(any(lo <= a.ctypes.data < hi for lo, hi in blocks)
               for s in pool.free for a in s.arrays)
    before, engine.prefiller = engine.prefiller, prefiller
    try:
        scheduler = Scheduler(engine, max_batch=3, gdn_pool=pool)
        scheduler.start()
        scheduler.stop()
    finally:
        engine.prefiller = before
    assert scheduler.gdn_pool is pool and prefiller.reserved == [3]
    assert len(prefiller.blocks) == 3


def test_preparing_runs_then_after_a_prepared_gpu_only():
    """hybrid.preparing's `then`: after prepare() succeeds (its result and seconds kept), not
    after it fails; a `then` that raises is said and left out."""
    from fermijit.prefill import hybrid

    class Prefiller:
        def __init__(self, ok):
            self.ok = ok

        def prepare(self):
            return self.ok

    for ok in (True, False):
        with hybrid.preparing(Prefiller(ok), lambda: "made") as result:
            pass
        assert (result.get("then"), "then_s" in result) == (("made", True) if ok else
                                                             (None, False))

    def bad():
        raise RuntimeError("cuMemHostAlloc failed: out of memory (test)")

    with hybrid.preparing(Prefiller(True), bad) as result:
        pass
    assert "then" not in result and result["seconds"] is not None


def test_preparing_runs_then_ahead_beside_the_rest_once_the_driver_is_up(monkeypatch):
    """hybrid.preparing with a GPU prefiller (on_driver): `then` (the server's page-locking) on a
    thread of its own from when prepare() has the driver up, while prepare() goes on (issue 28
    item 4: it had followed the GPU's start); not at all where the driver never came up; after
    prepare() with FERMIJIT_PIN_AHEAD=0."""
    import threading

    from fermijit.prefill import hybrid

    class Prefiller:
        def __init__(self, driver_ok):
            self.driver_ok, self.on_driver, self.order = driver_ok, None, []
            self.then_ran = threading.Event()

        def prepare(self):
            if not self.driver_ok:
                return False
            if self.on_driver is not None:
                self.on_driver()
                assert self.then_ran.wait(10)  # the rest of the start waits: `then` runs beside
            self.order.append("prepared")
            return True

        def then(self):
            self.order.append(threading.current_thread().name)
            self.then_ran.set()
            return "made"

    p = Prefiller(True)
    with hybrid.preparing(p, p.then) as result:
        pass
    assert result["then"] == "made" and p.order == ["fermijit-gpu-pin-ahead", "prepared"]
    assert result["then_started"] >= result["started"] and result["seconds"] is not None
    p = Prefiller(False)
    with hybrid.preparing(p, p.then) as result:
        pass
    assert "then" not in result and result["seconds"] is None
    monkeypatch.setenv(hybrid.PIN_AHEAD_ENV, "0")
    p = Prefiller(True)
    p.then_ran.set()
    with hybrid.preparing(p, p.then) as result:
        pass
    assert result["then"] == "made" and p.order[0] == "prepared"


def test_gpu_prefiller_page_locks_the_room_and_pool_once_the_driver_is_up(engine, monkeypatch):
    """GpuPrefiller.reserve and host_memory with the driver up and the device model not yet made
    (page-locked ahead): the room goes to its host buffers (which the device model takes), the
    pool's memory is page-locked; without the driver, prepare() decides (here: no GPU)."""
    from fermijit.jit import gpu
    from fermijit.prefill import hybrid

    pinned = []
    monkeypatch.setattr(gpu, "pinned", lambda n: pinned.append(n) or np.zeros(n, np.uint8))
    prefiller = hybrid.GpuPrefiller(engine.model, is_quiet_without_gpu=True)
    prefiller.driver_up.set()
    prefiller.reserve(2)
    assert prefiller.device is None and list(prefiller.host_buffers) == ["state"]
    assert prefiller.host_buffers["state"].nbytes >= 2 * engine.model.state_nbytes(
        hybrid.RESERVE_TOKENS)
    assert prefiller.host_memory(4096).nbytes == 4096 and len(pinned) == 2
    if gpu.unavailable_reason() is not None:
        other = hybrid.GpuPrefiller(engine.model, is_quiet_without_gpu=True)
        assert not other.driver_ready() and other.host_memory(8).nbytes == 8
        assert len(pinned) == 2


def test_a_prompt_cancelled_while_it_prefills_gives_its_states_back(engine, prompts):  # noqa: F811
    """A client gone while its prompt waited to be prefilled (`_drop_cancelled`): its sequence
    was dropped without giving its GDN states to the pool, so each such request took a state's
    worth for good (with the GPU, page-locked; past max_batch of them every new sequence's
    hand-off page-faulted through fresh arrays)."""
    from fermijit.engine import Engine
    from fermijit.server import prompts as preparing, protocol
    from fermijit.server.scheduler import Scheduler

    pool = GdnPool(engine.model, 2)
    pool.fill(2)
    n_free = len(pool.free)
    scheduler = Scheduler(Engine(engine.model, engine.tokenizer, None, Reserving(engine.model)),
                          max_batch=2, gdn_pool=pool)  # driven on this thread
    job = protocol.parse({"prompt": [int(t) for t in prompts[0]], "max_tokens": 4}, False)
    job.emit = lambda event: None
    preparing.prepare(scheduler.engine, job)
    scheduler.submit(job)
    scheduler._admit()
    assert scheduler.prefilling and len(pool.free) < n_free
    job.cancelled.set()
    scheduler._prefill_chunk()
    assert not scheduler.prefilling and scheduler.n_cancelled == 1
    pool.wait()
    assert len(pool.free) == n_free
    assert all(not a.any() for s in pool.free for a in s.arrays)


def test_preparing_holds_the_gpu_pass_until_the_block_ends_where_asked(monkeypatch):
    """FERMIJIT_GPU_PASS_AFTER=1 (issue 28 item 4's experiment): the GPU prefiller's pass_gate,
    which its 2-token pass waits for, opens when the block (the CPU kernels' warm-up) ends;
    without the variable there is no gate."""
    import threading

    from fermijit.jit import omp
    from fermijit.prefill import hybrid

    if not omp.available():
        pytest.skip("without the omp layer the GPU starts after the block anyway")

    class Prefiller:
        pass_gate = None

        def prepare(self):
            if self.pass_gate is not None:
                assert self.pass_gate.wait(10)
                self.order.append("pass")
            return True

    for asked in (False, True):
        if asked:
            monkeypatch.setenv(hybrid.PASS_AFTER_ENV, "1")
        p = Prefiller()
        p.order = []
        with hybrid.preparing(p):
            gate = p.pass_gate
            threading.Event().wait(0.05)  # time for the GPU's thread to pass a missing gate
            p.order.append("block")
        assert (gate is not None) == asked
        assert p.order == (["block", "pass"] if asked else ["block"])
