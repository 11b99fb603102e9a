"""REAP expert pruning (Router-weighted Expert Activation Pruning): calibration and the
choice of the experts kept. model/prune.py writes the pruned model.

Calibration runs the engine's prefill over windows of a text, with the MTP head's rows where the
model has one (its layer is row L of the statistics, after the L layers: model/mtp.py). At each
MoE layer (through `Model.moe_observer`), for expert j and the tokens X_j the router sends to it:
    count_j    = |X_j|
    saliency_j = (1 / |X_j|) · Σ_{x ∈ X_j} g_j(x) · ‖E_j(x)‖₂            (0 when X_j is empty)
g_j(x) the router's softmax probability of j over all E experts (not the renormalised top-k weight
the MoE scales by: CerebrasResearch/reap's observer default, `renormalize_router_weights=False`;
on a top-8-of-256 model the top-k mass differs between tokens, and renormalising inflates the
weight of tokens whose router was unsure), E_j(x) the expert's SwiGLU output without the weight
(ops.moe), computed here with the engine's ops: W4A8 for a fermijit model, fp32 for an HF
checkpoint. Pruning to `keep` experts per layer keeps the `keep` highest scores (ties to the lower
id), in their original order. The score is the saliency (REAP), or for comparison the count
(frequency) or a seeded random number.

`reference` is the numpy spec of one layer's statistics from its MoE inputs.
Dimensions: L layers, E experts, k experts per token, T tokens, H hidden, I expert intermediate.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fermijit import FermijitError
from fermijit.ops import matvec, moe, router

CRITERIA = ("reap", "frequency", "random")


@dataclasses.dataclass(frozen=True)
class Calibration:
    counts: np.ndarray    # [L (+1: the MTP layer), E] int64: tokens routed to each expert
    saliency: np.ndarray  # [L (+1), E] float64: REAP saliency, 0 where never routed
    source: str           # what text it came from
    n_tokens: int         # tokens run through the model
    n_windows: int
    context: int          # tokens per window

    def scores(self, criterion: str, seed: int = 0) -> np.ndarray:
        """[L, E]: higher is kept first."""
        if criterion == "reap":
            return self.saliency
        if criterion == "frequency":
            return self.counts.astype(np.float64)
        if criterion == "random":
            return np.random.default_rng(seed).random(self.counts.shape)
        raise FermijitError(f"unknown pruning criterion {criterion!r}: one of "
                            f"{', '.join(CRITERIA)}")

    def as_dict(self) -> dict:
        return {"source": self.source, "n_tokens": self.n_tokens, "n_windows": self.n_windows,
                "context": self.context}


def check_keep(keep: int, n_experts: int, top_k: int) -> None:
    if not isinstance(keep, (int, np.integer)) or not top_k <= keep <= n_experts:
        raise FermijitError(f"--keep must be between the {top_k} experts each token uses "
                            f"(num_experts_per_tok) and the model's {n_experts}, got {keep}")


def keep_for_ratio(ratio: float, n_experts: int, top_k: int) -> int:
    """Experts kept when pruning the fraction `ratio` of them (rounded to the nearest), at least
    the `top_k` each token uses: the error names --ratio, the flag given, and its range here."""
    keep = int(round(n_experts * (1 - ratio))) if 0 <= ratio < 1 else 0
    if not top_k <= keep <= n_experts:
        raise FermijitError(f"--ratio is the fraction of experts pruned, from 0 (keep all "
                            f"{n_experts}) to {1 - top_k / n_experts:g} (keep the {top_k} each "
                            f"token uses, num_experts_per_tok), got {ratio}")
    return keep


def choose(scores: np.ndarray, keep: int) -> np.ndarray:
    """[L, keep] int64: per layer the ids of the `keep` highest scores (ties to the lower id),
    ascending."""
    best = np.argsort(-scores, axis=1, kind="stable")[:, :keep]
    return np.sort(best, axis=1)


def gate_probabilities(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """[T, k] float64: REAP's g_j(x), the softmax over all experts of the router's `logits` [T, E]
    at the chosen `ids` [T, k]."""
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return np.take_along_axis(z, ids.astype(np.int64), axis=1) / z.sum(axis=1, keepdims=True)


def expert_output(experts, e: int, x: np.ndarray) -> np.ndarray:
    """E_e(x) [n, H] for x [n, H] fp32: expert e's SwiGLU as the engine's MoE computes it."""
    from fermijit.model.forward import silu

    if isinstance(experts, moe.MoeWeights):  # W4A8, as ops.moe's prefill
        gu = matvec.cpu(experts.gate_up_qs[e], experts.gate_up_d[e], x)
        g, u = np.split(gu, 2, axis=1)
        return matvec.cpu(experts.down_qs[e], experts.down_d[e], silu(g) * u)
    g, u = np.split(x @ experts.gate_up[e].T, 2, axis=1)          # fp32 (forward.DenseExperts)
    return (silu(g) * u) @ experts.down[e].T


class RoutedCounts:
    """An MoE observer (Model.moe_observer) counting the routed slots per layer and expert."""

    def __init__(self, model):
        layers = moe_layers(model)  # the MTP head's MoE last, where the model has one
        self._layer_of = {id(w): i for i, w in enumerate(layers)}
        self.counts = np.zeros((len(layers), model.n_experts), np.int64)

    def __call__(self, layer, x, ids, weights) -> None:
        """The CPU forward's layer, its MoE input x [T, H], routing ids and weights [T, k]."""
        i = self._layer_of[id(layer)]
        self.counts[i] += np.bincount(ids.reshape(-1), minlength=self.counts.shape[1])


class Collector(RoutedCounts):
    """The calibration's MoE observer: per layer and expert, the routed count and Σ g·‖E(x)‖."""

    def __init__(self, model):
        super().__init__(model)
        self.weighted_norms = np.zeros(self.counts.shape, np.float64)

    def __call__(self, layer, x, ids, weights) -> None:
        i = self._layer_of[id(layer)]
        g = gate_probabilities(x @ layer.router.T, ids)     # the engine's fp32 logits
        for e in np.unique(ids):
            t, k = np.nonzero(ids == e)                      # a token picks an expert once
            y = expert_output(layer.experts, int(e), x[t])
            norms = np.linalg.norm(y.astype(np.float64), axis=1)
            self.counts[i, e] += t.size
            self.weighted_norms[i, e] += float(g[t, k] @ norms)

    def add_slots(self, i: int, experts, weights, norms) -> None:
        """The GPU prefill's observer (hybrid.GpuPrefiller.observer): layer i's routed slots, the
        expert of each, its g_j(x) (gate_probabilities) and ‖E(x)‖₂ (gpu_prefill.observe)."""
        n = self.counts.shape[1]
        self.counts[i] += np.bincount(experts, minlength=n)
        self.weighted_norms[i] += np.bincount(experts, weights * norms, minlength=n)

    def saliency(self) -> np.ndarray:
        return np.divide(self.weighted_norms, self.counts, out=np.zeros_like(self.weighted_norms),
                         where=self.counts > 0)


def moe_layers(model) -> tuple:
    """The model's MoE layers: its L layers, then its MTP head's (model/mtp.py) if it has one."""
    return model.layers + ((model.mtp.layer,) if model.mtp is not None else ())


def dropped_share(counts: np.ndarray, kept: np.ndarray) -> float:
    """Mean over layers of the share of the routed slots (counts [L, E]) that went to experts
    outside kept [L, keep]: what pruning to `kept` takes from the routing it was measured on."""
    total = counts.sum(axis=1)
    kept_slots = np.take_along_axis(counts, kept, axis=1).sum(axis=1)
    return float(np.mean(1 - kept_slots / np.maximum(total, 1)))


def _ranks(a: np.ndarray) -> np.ndarray:
    """Ranks of a [E] from 0, ties given their mean rank."""
    _, value_of, n_tied = np.unique(a, return_inverse=True, return_counts=True)
    first = np.cumsum(n_tied) - n_tied
    return (first + (n_tied - 1) / 2)[value_of]


def layer_spread(cal: Calibration) -> list[dict]:
    """Per layer, how much there is to choose from: `effective_experts` exp(entropy)
    of the routed-slot distribution (E when flat: pruning half drops half the slots whatever the
    criterion), `saliency_cv` std/mean of the saliencies over the experts (0: REAP cannot tell
    them apart), `rank_corr` Spearman's between saliency and count (1: REAP keeps what frequency
    keeps)."""
    rows = []
    for counts, saliency in zip(cal.counts.astype(np.float64), cal.saliency):
        p = counts / max(counts.sum(), 1)
        entropy = -float(np.sum(p[p > 0] * np.log(p[p > 0])))
        mean = saliency.mean()
        by_saliency, by_count = _ranks(saliency), _ranks(counts)
        constant = by_saliency.std() == 0 or by_count.std() == 0       # no order to agree with
        rows.append({"effective_experts": float(np.exp(entropy)),
                     "saliency_cv": float(saliency.std() / mean) if mean > 0 else 0.0,
                     "rank_corr": 0.0 if constant else
                     float(np.corrcoef(by_saliency, by_count)[0, 1])})
    return rows


def check_context(context: int | None, max_context: int) -> int:
    """--ctx, checked; None: eval's default window (512), at most max_position_embeddings (a
    model of a shorter context failed with the default before)."""
    from fermijit.evaluate import DEFAULT_CONTEXT

    if context is None:
        return min(DEFAULT_CONTEXT, max_context)
    if not 1 <= context <= max_context:
        raise FermijitError(f"--ctx must be between 1 and {max_context} "
                            f"(max_position_embeddings), got {context}")
    return context


def window_length(context: int, max_tokens: int | None) -> int:
    """Tokens per calibration window: `context` (--ctx), or `max_tokens` where that is fewer (one
    shorter window), so that at most --max-tokens tokens are calibrated on."""
    return context if max_tokens is None else min(context, max_tokens)


def windows(n_tokens: int, context: int, max_tokens: int | None = None) -> np.ndarray:
    """Start offsets of the calibration windows: whole windows of `context` tokens (of
    `window_length`), at most `max_tokens` tokens in all, spread evenly over the text (the
    default corpus' documents are in path order: the first windows alone would see one part of
    the docs)."""
    n_whole = n_tokens // context
    if n_whole == 0:
        flag = "--max-tokens" if max_tokens == context else "--ctx"
        raise FermijitError(f"the calibration text has {n_tokens} tokens, fewer than one window "
                            f"of {context} ({flag})")
    n = n_whole if max_tokens is None else min(n_whole, max(1, max_tokens // context))
    return np.round(np.linspace(0, n_whole - 1, n)).astype(np.int64) * context


def calibration_tokens(n_tokens: int, context: int, max_tokens: int | None = None) -> int:
    """Tokens `calibrate` reads of a text of n_tokens (its windows' total): the progress bar's."""
    window = window_length(context, max_tokens)
    return windows(n_tokens, window, max_tokens).size * window


def calibrate(model, tokens, context: int, source: str, max_tokens: int | None = None,
              on_tokens=lambda n: None, prefiller=None) -> Calibration:
    """Statistics of `model` (forward.Model) over `tokens` [N], each window from a fresh state;
    `on_tokens(n)` after each prefill pass of n tokens (progress). `prefiller`
    (fermijit/prefill/hybrid.py, default the CPU forward): a GPU prefill observes its own MoE steps
    (with the CPU's 8-bit activation rounding, gpu_prefill's numerics); whatever falls back to the
    CPU is observed there."""
    tokens = np.asarray(tokens, dtype=np.int32)
    context = window_length(check_context(context, model.max_context), max_tokens)
    starts = windows(tokens.size, context, max_tokens)
    collector = Collector(model)
    gpu = getattr(prefiller, "gpu", prefiller)                # auto's GPU side, or gpu itself
    observed_on_gpu = hasattr(gpu, "observer") and gpu.prepare()
    model.moe_observer = collector
    if observed_on_gpu:
        gpu.observer = collector.add_slots
    try:
        for s in starts:
            window = tokens[s:s + context]
            state = model.new_state(context, mtp=model.mtp is not None)  # the head's rows too
            if prefiller is None:
                model.prefill(window, state, on_block=on_tokens)
            else:
                prefiller.prefill(window, state, on_block=on_tokens)
    finally:
        model.moe_observer = None
        if observed_on_gpu:
            gpu.observer = None
    return Calibration(collector.counts, collector.saliency(), source, int(starts.size * context),
                       int(starts.size), context)


def reference(x, router_w, gate_up, down, top_k):
    """One layer's (counts [E] int64, saliency [E] float64) from its MoE inputs x [T, H] fp32, the
    router [E, H] and the experts gate_up [E, 2I, H], down [E, H, I] as model/reference.py takes
    them (fp32, or QuantTensor: W4A8 for the engine's activation rounding); float64 after
    routing."""
    from fermijit.model.reference import expert, swiglu

    n_experts = router_w.shape[0]
    logits = x.astype(np.float32) @ router_w.T                       # the engine's logits
    ids, _ = router.reference(logits, top_k)
    counts, sums = np.zeros(n_experts, np.int64), np.zeros(n_experts)
    for t in range(x.shape[0]):
        p = np.exp(logits[t].astype(np.float64) - logits[t].max())
        for e in ids[t]:
            g = p[e] / p.sum()
            y = swiglu(x[t:t + 1].astype(np.float64), expert(gate_up, e), expert(down, e))[0]
            counts[e] += 1
            sums[e] += g * np.linalg.norm(y)
    return counts, np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
