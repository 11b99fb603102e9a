"""Next-token sampling: temperature, top-k, top-p, then the inverse CDF at a caller's u.

temperature 0 is greedy: the first maximum (lowest id on ties). Otherwise, with
z = (logits - max logit) / T (the difference first: logits / T overflowed to inf for a subnormal
T such as 5e-324, and inf - inf sampled the least likely token; this way T -> 0 is greedy):
  1. keep the top_k most likely tokens (0 = all);
  2. of those, keep the smallest most-likely prefix whose probability (the softmax of z over the
     tokens kept so far) reaches top_p (1.0 = all);
  3. renormalise, and take the first token, in descending probability with ties to the lower id,
     whose cumulative probability exceeds u.
This is the order of HF's warpers (temperature, top-k, top-p). u is uniform in [0, 1), drawn by
the caller (`Sampler`) from a seeded generator, so reference and cpu are compared draw by draw;
they differ only if u falls within rounding (~1e-15) of a cumulative boundary.

Speculative decoding (fermijit/speculative.py) needs the distribution itself: `probabilities`
is what `reference` draws from, as a vector; `speculative` is the standard rejection rule
(Leviathan et al. 2023, Chen et al. 2023) that turns drafts from a distribution q into tokens
distributed as the model's p.
Dimensions: V vocabulary (248320), k = top_k, N drafts.
"""

from __future__ import annotations

import math

import numpy as np

from fermijit import FermijitError
from fermijit.jit.checks import check_array
from fermijit.jit.cpu import kernel


def check_settings(temperature, top_k, top_p) -> None:
    """FermijitError unless temperature >= 0, top_k >= 0 (an int) and 0 < top_p <= 1."""
    if not (isinstance(temperature, (int, float, np.integer, np.floating))
            and math.isfinite(temperature) and temperature >= 0):
        raise FermijitError(f"sampling: temperature must be a finite number >= 0, got "
                            f"{temperature!r}")
    if not (isinstance(top_k, (int, np.integer)) and top_k >= 0):
        raise FermijitError(f"sampling: top_k must be an int >= 0 (0 = all), got {top_k!r}")
    if not (isinstance(top_p, (int, float, np.integer, np.floating)) and 0.0 < top_p <= 1.0):
        raise FermijitError(f"sampling: top_p must be in (0, 1] (1 = all), got {top_p!r}")


def _check_u(u) -> None:
    if not (isinstance(u, (float, np.floating)) and 0.0 <= u < 1.0):
        raise FermijitError(f"sampling: u must be a float in [0, 1), got {u!r}")


def reference(logits, temperature, top_k, top_p, u):
    """logits [V] fp32 -> token id (int)."""
    check_settings(temperature, top_k, top_p)
    _check_u(u)
    if temperature == 0:
        return int(np.argmax(logits))                             # first maximum
    order = np.argsort(-logits, kind="stable")                    # [V] descending, ties by id
    if top_k > 0:
        order = order[:top_k]
    top = np.float64(logits[order[0]])
    with np.errstate(over="ignore"):  # a tiny T: -inf, probability 0, as meant
        p = np.exp((logits[order].astype(np.float64) - top) / temperature)
    p /= p.sum()
    if top_p < 1.0:
        p = p[:np.searchsorted(np.cumsum(p), top_p) + 1]          # first prefix with mass >= top_p
    cdf = np.cumsum(p) / p.sum()
    i = np.searchsorted(cdf, u, side="right")                     # first cdf > u
    return int(order[min(i, p.size - 1)])                         # (rounding: cdf[-1] < u)


def probabilities(logits, temperature, top_k, top_p) -> np.ndarray:
    """The distribution `reference` draws from at temperature > 0: [V] float64, 0 outside the
    tokens top-k and top-p keep. The top-k candidates are found by a partition (V log V for a
    sort of the real vocabulary was ~20 ms), ties to the lower id as `reference` breaks them."""
    check_settings(temperature, top_k, top_p)
    if temperature == 0:
        raise FermijitError("sampling: probabilities need a temperature > 0 (0 is greedy)")
    logits = np.asarray(logits, np.float32)
    vocab = logits.shape[0]
    if 0 < top_k < vocab:
        kth = np.partition(logits, vocab - top_k)[vocab - top_k]          # the k-th largest
        above = np.flatnonzero(logits > kth)
        ids = np.concatenate([above, np.flatnonzero(logits == kth)[:top_k - above.size]])
    else:
        ids = np.arange(vocab)
    if top_p < 1.0 or 0 < top_k < vocab:                                    # descending, ties by id
        ids = ids[np.lexsort((ids, -logits[ids]))]
    z = logits[ids].astype(np.float64)
    with np.errstate(over="ignore"):  # a tiny T: -inf, probability 0, as meant
        p = np.exp((z - z.max()) / temperature)
    p /= p.sum()
    if top_p < 1.0:
        n = np.searchsorted(np.cumsum(p), top_p) + 1                        # as `reference`
        ids, p = ids[:n], p[:n] / p[:n].sum()
    out = np.zeros(vocab)
    out[ids] = p
    return out


def draw(p, u: float) -> int:
    """A token of distribution p [V] (float64, summing to 1) at uniform u: the first in id order
    whose cumulative probability exceeds u."""
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), p.size - 1))


def speculative(p, q, drafts, rng) -> tuple[int, int]:
    """Drafts d_i drawn from q[i] (q [N, V]), the model's distributions p [N+1, V] after each of
    them (p[i] the one for d_i's position) -> (n accepted, the token that follows them): d_i is
    accepted with probability min(1, p[i][d_i] / q[i][d_i]); at the first rejection the token
    is drawn from the residual max(0, p[i] - q[i]), normalised; after N acceptances from p[N].
    Every token is then distributed as p: the standard rule (Leviathan et al. 2023, Theorem 1).
    `rng` a numpy Generator: one draw per test and one for the token."""
    for i, d in enumerate(drafts):
        if rng.random() * q[i][d] < p[i][d]:
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        return i, draw(residual / residual.sum(), rng.random())
    return len(drafts), draw(p[len(drafts)], rng.random())


# --- kernels ------------------------------------------------------------------------------------
# Candidates live in a binary heap of token ids, so a small top_k costs one pass over the
# vocabulary (a heap of the k best seen, worst on top) and never a sort of all V; the nucleus and
# the draw then pop tokens best-first only as far as they need. Measured per token at V = 248320
# (CI box): greedy 0.13 ms, top_k 20 0.14 ms, top_k 0 with top_p 0.9 3.6 ms (V exps + a heapify).

@kernel
def _ranks_before(logits, i, j):
    # Token i comes before token j: more likely, or as likely with a lower id.
    return logits[i] > logits[j] or (logits[i] == logits[j] and i < j)


@kernel
def _sift_down(heap, n, root, logits, is_best_on_top):  # heap [n]
    while True:
        child = 2 * root + 1
        if child >= n:
            return
        if child + 1 < n and _ranks_before(logits, heap[child + 1], heap[child]) == is_best_on_top:
            child += 1
        if _ranks_before(logits, heap[child], heap[root]) != is_best_on_top:
            return
        heap[root], heap[child] = heap[child], heap[root]
        root = child


@kernel
def _heapify(heap, n, logits, is_best_on_top):
    for root in range(n // 2 - 1, -1, -1):
        _sift_down(heap, n, root, logits, is_best_on_top)


@kernel
def _pop_best(heap, n, logits):
    # Moves the best of heap[0:n] to heap[n - 1] and re-heaps heap[0:n - 1].
    heap[0], heap[n - 1] = heap[n - 1], heap[0]
    _sift_down(heap, n - 1, 0, logits, True)


@kernel
def _sample_token(logits, temperature, top_k, top_p, u, heap):  # logits [V]; heap [>= min(k, V)]
    vocab = logits.shape[0]
    if temperature == 0.0:
        best = 0
        best_logit = logits[0]
        for i in range(1, vocab):
            if logits[i] > best_logit:
                best = i
                best_logit = logits[i]
        return best

    if 0 < top_k < vocab:
        n = top_k
        for i in range(n):
            heap[i] = i
        _heapify(heap, n, logits, False)
        worst = logits[heap[0]]
        for i in range(n, vocab):
            if logits[i] > worst:         # i is past every kept id, so it loses ties
                heap[0] = i
                _sift_down(heap, n, 0, logits, False)
                worst = logits[heap[0]]
    else:
        n = vocab
        for i in range(n):
            heap[i] = i
    _heapify(heap, n, logits, True)

    top = np.float64(logits[heap[0]])
    total = 0.0
    for i in range(n):
        total += math.exp((np.float64(logits[heap[i]]) - top) / temperature)

    # Popped tokens collect at the end of the heap: heap[n - 1] is the most likely.
    n_kept = n
    n_popped = 0
    mass = 1.0
    if top_p < 1.0:
        mass = 0.0
        n_kept = 0
        while n_kept < n:
            _pop_best(heap, n - n_kept, logits)
            n_kept += 1
            mass += math.exp((np.float64(logits[heap[n - n_kept]]) - top) / temperature) / total
            if mass >= top_p:
                break
        n_popped = n_kept

    target = u * mass
    cum = 0.0
    token = -1
    for r in range(n_kept):
        if r == n_popped:
            _pop_best(heap, n - r, logits)
            n_popped += 1
        token = heap[n - 1 - r]
        cum += math.exp((np.float64(logits[token]) - top) / temperature) / total
        if cum > target:
            return token
    return token                          # rounding left the target past the last sum


def heap_size(vocab_size: int, top_k: int) -> int:
    """Entries the `scratch` of `cpu` needs: the k best, or the whole vocabulary."""
    return top_k if 0 < top_k < vocab_size else vocab_size


def cpu(logits, temperature, top_k, top_p, u, scratch=None):
    """logits [V] fp32 -> token id (int). `scratch` int32 [>= heap_size(V, top_k)] holds the
    candidate heap (allocated per call when None); the result is a scalar, so there is no `out`."""
    op = "sampling"
    check_settings(temperature, top_k, top_p)
    _check_u(u)
    check_array(op, "logits", logits, np.float32, ndim=1)
    vocab = logits.shape[0]
    if vocab == 0:
        raise FermijitError(f"{op}: logits is empty")
    need = heap_size(vocab, top_k)
    if scratch is None:
        scratch = np.empty(need, np.int32)
    check_array(op, "scratch", scratch, np.int32, ndim=1)
    if scratch.shape[0] < need:
        raise FermijitError(f"{op}: scratch holds {scratch.shape[0]} ids, needs {need}")
    return int(_sample_token(logits, float(temperature), int(top_k), float(top_p), float(u),
                             scratch))


class Sampler:
    """One sequence's sampling: the settings, a seeded generator for u, and the candidate heap,
    so a token costs one draw and no allocation."""

    def __init__(self, vocab_size: int, *, temperature: float, top_k: int, top_p: float,
                 seed: int):
        check_settings(temperature, top_k, top_p)
        if vocab_size < 1:
            raise FermijitError(f"sampling: vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.temperature = float(temperature)
        # Past the vocabulary, top-k keeps everything: clamped, so --top-k 2**64 or top_k 1e30
        # in generation_config.json cannot overflow the kernel's int64 (issue 11 case 6).
        self.top_k = min(int(top_k), vocab_size)
        self.top_p = float(top_p)
        self.rng = np.random.default_rng(seed)
        self._heap = np.empty(heap_size(vocab_size, self.top_k), np.int32)

    def sample(self, logits: np.ndarray) -> int:
        """logits [V] fp32 -> the next token id."""
        if np.shape(logits) != (self.vocab_size,):
            raise FermijitError(f"sampling: logits has shape {list(np.shape(logits))}, expected "
                                f"[{self.vocab_size}]")
        return cpu(logits, self.temperature, self.top_k, self.top_p, self.rng.random(),
                   scratch=self._heap)
