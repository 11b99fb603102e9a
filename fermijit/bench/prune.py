"""`python -m fermijit bench prune`: what pruning costs in held-out perplexity.

The model is calibrated once on `--text`, then pruned to the same expert count by each criterion
of model/reap.py (REAP saliency, routed-token frequency, seeded random), and the full model and
each pruned one score `--heldout` as `eval` does (W4A8, windows from a fresh state: `--ctx`, the
calibration's, default 512 at most max_position_embeddings; a model trained on shorter windows,
as `training/train.py --preset small`'s 128, is best scored at its own).
Keep the two texts disjoint: e.g. the default corpus' train split for calibration and its held-out
split (or tests/model/data/heldout_sample.txt, one held-out document) for scoring.

Each row also gives `dropped_share`: the share of the full model's routed slots on the held-out
text that went to the experts the row drops (mean over layers). Below the rows, per layer from the
calibration (reap.layer_spread): the effective number of experts of the routing (exp entropy),
the saliencies' spread (std/mean) and their rank correlation with the counts: a flat routing
leaves no choice that spares much, and saliencies that follow the counts make REAP frequency.

REAP's evaluation model (the real checkpoint's routing recipe over the `small` preset;
training/train.py `--routing real`, ~1 h of one CPU core) and its bench:

    python -m training.train --data CORPUS --out /tmp/reapeval/hf --routing real \
        --preset small --steps 2400 --evals 4 --eval-tokens 65536 --device cpu --threads 1
    python -m fermijit convert /tmp/reapeval/hf /tmp/reapeval/fj
    python -m fermijit bench prune --model /tmp/reapeval/fj --text CORPUS/train.txt \
        --heldout CORPUS/heldout.txt --ratio 0.25 --ratio 0.5 --max-tokens 65536 --ctx 128

Measured there (2026-12-02; held-out 151,932 tokens; full model 40.11): at 192 of 256 experts REAP
+1.28 %, frequency +2.84 %, random +15.3 %; at 128 REAP +10.17 % (+9.84 % calibrated on 262,144
tokens), frequency +11.6 %, random +60.4 %. REAP drops 24 % of the held-out routed slots at 128,
frequency 6 %: the routing is concentrated (60-70 effective experts of 256 in layers 1-3, 151 in
layer 0) and the saliencies spread widely (cv 1.1-4.2) with little rank agreement with the counts
(-0.2 to 0.4): rarely routed experts that matter are what REAP keeps and frequency drops.
With the gate fixed to the reference's (the router's softmax probability, 2026-12-03): REAP +9.1 %
at 128, frequency +11.6 %.

The `default` preset with the same recipe (tests/reap_eval_pass.sh on the H200: 721 steps, 2.5 of
its 3.5 epochs; 65,536 calibration tokens at 512; held-out 151,932 tokens; full model 29.77;
2026-12-03): at 192 REAP +15.4 %, frequency +10.3 %, random +30.9 %; at 128 REAP +50.2 %,
frequency +33.7 %, random +98.1 %, dropping 45 %, 8.6 % and 48 % of the routed slots. Effective
experts 54-226 of 256 (layer 3 the fewest), saliency cv 0.55-3.8, rank correlation with the
counts -0.18 to 0.48: here the experts REAP keeps for their large mean contribution are routed
too rarely to pay for the busy ones it drops, and frequency is the better criterion.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from fermijit import FermijitError


def _nbytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def run(model_dir: Path, text_path: Path, heldout_path: Path, keeps: tuple[int, ...],
        ratios: tuple[float, ...], context: int | None, max_tokens: int | None, seed: int,
        as_json: bool) -> list[dict]:
    """Rows for the full model, then per expert count (each of `keeps`, and each of `ratios`
    pruned) each criterion's; calibration runs once."""
    from tqdm import tqdm

    from fermijit.evaluate import read_text, score
    from fermijit.model import convert, prune, reap
    from fermijit.model.forward import load_model
    from fermijit.model.tokenizer import Tokenizer

    if not convert.is_fermijit_model(model_dir):
        raise FermijitError(f"{model_dir}: bench prune takes a fermijit model (convert it first)")
    if not keeps and not ratios:
        raise FermijitError("give --keep or --ratio (either may be repeated)")
    cfg, model = load_model(model_dir)
    text = cfg.text_config
    keeps = set(keeps) | {reap.keep_for_ratio(r, text.num_experts, text.num_experts_per_tok)
                          for r in ratios}
    for keep in keeps:
        reap.check_keep(keep, text.num_experts, text.num_experts_per_tok)
    context = reap.check_context(context, model.max_context)
    tokenizer = Tokenizer(model_dir, text.eos_token_id, model.vocab_size)
    calibration = tokenizer.encode(read_text(text_path))
    heldout = tokenizer.encode(read_text(heldout_path))
    n_cal = reap.calibration_tokens(calibration.size, context, max_tokens)
    with tqdm(total=n_cal, desc="calibrate", unit="tok", file=sys.stderr) as bar:
        cal = reap.calibrate(model, calibration, context, str(text_path), max_tokens, bar.update)

    def evaluate(directory: Path, label: str, count_routing: bool = False):
        """Held-out perplexity, and the routed slots counted (reap.RoutedCounts) or None."""
        _, m = load_model(directory)
        routed = m.moe_observer = reap.RoutedCounts(m) if count_routing else None
        with tqdm(total=heldout.size - 1, desc=f"eval {label}", unit="tok",
                  file=sys.stderr) as bar:
            return score(m, heldout, context, bar.update).perplexity, routed

    full, routed = evaluate(model_dir, "full", count_routing=True)
    rows = [{"model": "full", "experts": text.num_experts, "perplexity": full,
             "change": 0.0, "dropped_share": 0.0, "weights_nbytes": _nbytes(model_dir)}]
    with tempfile.TemporaryDirectory() as tmp:
        for keep in sorted(keeps, reverse=True):
            for criterion in reap.CRITERIA:
                dst = Path(tmp) / f"{criterion}-{keep}"
                kept = reap.choose(cal.scores(criterion, seed), keep)
                prune.prune_fermijit(model_dir, dst, kept, {"criterion": criterion,
                                                            "calibration": cal.as_dict()})
                ppl, _ = evaluate(dst, f"{criterion} {keep}")
                rows.append({"model": criterion, "experts": keep, "perplexity": ppl,
                             "change": ppl / full - 1,
                             "dropped_share": reap.dropped_share(routed.counts, kept),
                             "weights_nbytes": _nbytes(dst)})
    layers = reap.layer_spread(cal)
    info = {"model": str(model_dir), "calibration": cal.as_dict(), "heldout": str(heldout_path),
            "heldout_tokens": int(heldout.size), "eval_context": context, "seed": seed,
            "layers": layers}
    if as_json:
        print(json.dumps({**info, "rows": rows}))
    else:
        print(f"calibration: {cal.n_tokens} tokens of {text_path} ({cal.n_windows} windows of "
              f"{context}); held-out: {heldout.size} tokens of {heldout_path}")
        print(f"{'model':<10} {'experts':>7} {'perplexity':>10} {'change':>8} "
              f"{'dropped slots':>13} {'size MB':>8}")
        for r in rows:
            print(f"{r['model']:<10} {r['experts']:>7} {r['perplexity']:>10.3f} "
                  f"{r['change']:>+8.2%} {r['dropped_share']:>13.2%} "
                  f"{r['weights_nbytes'] / 1e6:>8.2f}")
        print(f"\nper layer, from the calibration ({text.num_experts} experts):")
        print(f"{'layer':>5} {'effective experts':>17} {'saliency cv':>11} {'rank corr':>9}")
        for i, layer in enumerate(layers):
            print(f"{i:>5} {layer['effective_experts']:>17.1f} {layer['saliency_cv']:>11.3f} "
                  f"{layer['rank_corr']:>9.3f}")
    return rows
