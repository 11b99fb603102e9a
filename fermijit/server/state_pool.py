"""Resident GDN states for the server's new sequences (issue 28 item 5).

A new sequence's GDN states (~65 MB at full size: the conv windows and recurrent states of its
30 GDN layers) were fresh zeros, pages the OS backs only when first written, so the GPU
prefill's hand-off (fermijit/prefill/gpu_state.py hand_off) page-faulted its way through them:
0.06-0.26 s for 8 prompts together on the H200's host (0.02 s for one), the difference between
their last first token and one prompt's. The pool keeps the GDN states of sequences that ended,
zeroed, and gives them to new ones, so the hand-off writes memory already resident; the
server fills it with a batch's worth before its first request where the GPU prefills, in
page-locked memory, which the hand-off's DMA then writes in place (no copy on the host). (A
server prefilling on the CPU pools nothing: capacity 0, its prefill's page faults are noise.)

The scheduler's thread alone calls it. A state is given back only once its sequence is over for
good (its snapshot taken): `give` takes its GDN layers out of it (its `layers` emptied), so an
ended state cannot write into arrays a live sequence now has. They are zeroed on threads of
the pool's (ZERO_THREADS; ~7 ms a state on one thread at full size: 8 ended together held the
scheduler ~50 ms) before `take` can hand them out again, so the pool gives zeros only; a state a
failed prefill may have half written is never given back (the scheduler drops it).

A batch that arrives as the previous one ends (the clients of the first send the next: the
bench's second batch of 8 concurrent prompts) finds the pool's states still being zeroed: `take`
waits for them (a few ms on ZERO_THREADS threads) rather than handing out fresh arrays, whose
page faults in the hand-off cost ~25 ms a sequence on the H200's host (8 prompts' "state out"
0.21-0.23 s against 0.05-0.07 s on the pool's states).
"""

from __future__ import annotations

import queue
import threading
import weakref

import numpy as np

from fermijit.model.state import GdnState, State

ALIGN = 64  # bytes: where each array starts in its block (the kernels' cache lines)
# Threads zeroing given-back states (numpy's fill releases the GIL): memset is bound by one
# core's store rate, several together by the memory's.
ZERO_THREADS = 4
# The longest `take` waits for a state being zeroed before it leaves a layer's fresh arrays
# (a safeguard: zeroing a full-size state takes ~7 ms on one thread).
TAKE_WAIT_S = 1.0


class GdnPool:
    """Zeroed, resident GdnStates of one model's shapes, at most `capacity` sequences' worth."""

    def __init__(self, model, capacity: int):
        self.shapes = ((model.conv_dim, model.conv_taps - 1),
                       (model.n_value_heads, model.key_dim, model.value_dim))
        self.n_layers = sum(not a for a in model.is_attention)
        self.capacity = capacity * self.n_layers  # GdnStates (one per GDN layer of a state)
        self.free: list[GdnState] = []    # zeroed, to take
        self._dirty: queue.Queue = queue.Queue()  # given back, to zero (`_zeroing`)
        self._held = 0                    # GdnStates free or to zero
        self._zeroing_now = 0             # GdnStates given back, not yet free
        self._zeroed = threading.Condition()
        self._zeroers: list[threading.Thread] = []
        self._made = weakref.WeakValueDictionary()  # id -> the arrays `fill` made (views)

    def fill(self, n_sequences: int, allocate=None) -> None:
        """Up to `n_sequences` states' GDN layers made now, zeroed (resident), each state's in
        one block of `allocate(nbytes)` (uint8; default np.empty; the GPU prefiller's
        page-locked memory)."""
        if not self.n_layers:
            return
        allocate = allocate or (lambda n: np.empty(n, np.uint8))
        sizes = [-(-4 * int(np.prod(shape)) // ALIGN) * ALIGN for shape in self.shapes]
        while len(self.free) + self.n_layers <= min(self.capacity, n_sequences * self.n_layers):
            block = allocate(sum(sizes) * self.n_layers + ALIGN)
            block.fill(0)
            at = -block.ctypes.data % ALIGN
            for _ in range(self.n_layers):
                pair = []
                for shape, size in zip(self.shapes, sizes):
                    pair.append(block[at:at + 4 * int(np.prod(shape))].view(np.float32)
                                .reshape(shape))
                    self._made[id(pair[-1])] = pair[-1]
                    at += size
                self.free.append(GdnState(*pair))
                self._held += 1

    def take(self, state: State) -> None:
        """A new state (position 0, all zeros): its GDN layers swapped for the pool's, as many as
        it holds (the others stay as they are); where none is free but some are being zeroed,
        after waiting for them."""
        if state.position != 0:
            return
        for i, s in enumerate(state.layers):
            if isinstance(s, GdnState):
                state.layers[i] = self.take_one() or s

    def take_one(self) -> GdnState | None:
        """A zeroed GdnState (after waiting, as `take`), or None where the pool has none: for
        Model.new_state's `gdn`, so a new state is made with the pool's arrays."""
        if not self._wait_free():
            return None
        self._held -= 1
        return self.free.pop()  # the zeroing threads only append

    def _wait_free(self) -> bool:
        """Whether a zeroed GdnState is free, waiting (at most TAKE_WAIT_S) for one being
        zeroed where none is yet."""
        if self.free:
            return True
        with self._zeroed:
            return self._zeroed.wait_for(lambda: self.free or not self._zeroing_now,
                                         TAKE_WAIT_S) and bool(self.free)

    def give(self, state: State) -> None:
        """A state no one reads or writes again: its GDN layers into the pool, to be zeroed
        (up to capacity; the rest, and arrays not its own or of other shapes, are left to the
        garbage collector), and `state.layers` emptied."""
        layers, state.layers = state.layers, []
        for s in layers:
            if isinstance(s, GdnState):  # to be zeroed: a row pending on it is not applied
                s.pending = None
            if self._held < self.capacity and self._fits(s):
                while len(self._zeroers) < ZERO_THREADS:
                    self._zeroers.append(threading.Thread(target=self._zeroing, daemon=True,
                                                          name="fermijit-gdn-zeroing"))
                    self._zeroers[-1].start()
                self._held += 1
                with self._zeroed:
                    self._zeroing_now += 1
                self._dirty.put(s)

    def _zeroing(self) -> None:
        while True:
            s = self._dirty.get()
            try:
                self._zero(s)
                with self._zeroed:
                    self.free.append(s)  # only once zeroed
            finally:
                with self._zeroed:
                    self._zeroing_now -= 1
                    self._zeroed.notify_all()
                self._dirty.task_done()

    @staticmethod
    def _zero(s: GdnState) -> None:
        s.conv.fill(0)  # numpy's fill releases the GIL
        s.recurrent.fill(0)

    def wait(self) -> None:
        """Until every state given back is zeroed and free (for the tests)."""
        self._dirty.join()

    def _fits(self, s) -> bool:
        return isinstance(s, GdnState) and all(
            a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
            and a.shape == shape and (a.flags.owndata or self._made.get(id(a)) is a)
            for a, shape in zip((s.conv, s.recurrent), self.shapes))
