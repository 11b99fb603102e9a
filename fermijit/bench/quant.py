"""`python -m fermijit bench quant --hf DIR --text FILE`: the quantisation mixes `convert --quant`
writes (model/quant_mix.py: q4_0, q4_k_m) of one HF checkpoint, side by side on this CPU (issue
34 item 5): held-out perplexity, next to the checkpoint's own unquantised (fp32, where it fits in
RAM); the weight bytes one decode token reads (bench decode's count: dense matrices, the LM
head, one embedding row, top-k experts a layer) and the matrices' bits per weight; decode tok/s,
medians of `--rounds` rounds that alternate the mixes in one process.

The excess NLL over fp32 is what quantisation cost; the bytes a token reads are what decode pays
for on a bandwidth-bound CPU (a full-size model: a small one's decode is bound by its per-token
work, so its tok/s here says little of a big one's; bench decode on `synth --quant` models
measures that, issue 34 item 4).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fermijit import FermijitError

DECODE_PROMPT = 16


def _matrix_bits(manifest) -> float:
    """Bits per weight of the quantised matrices (every tensor not f32/f16)."""
    from fermijit.model.manifest import stored_specs

    n_bytes = n_weights = 0
    for name, e in manifest.tensors.items():
        if e.quant in ("f32", "f16"):
            continue
        n_weights += int(np.prod(e.shape))
        for _, dtype, shape in stored_specs(name, e.shape, e.quant):
            n_bytes += int(np.prod(shape)) * (1 if dtype in ("U8", "I8") else 2)
    return 8 * n_bytes / max(n_weights, 1)


def _decode_s(model, prompt: np.ndarray, n_tokens: int) -> float:
    """Seconds of `n_tokens` greedy decode tokens after `prompt`."""
    state = model.new_state(prompt.size + n_tokens + 1)
    token = int(np.argmax(model.prefill(prompt, state)))
    start = time.perf_counter()
    for _ in range(n_tokens):
        token = int(np.argmax(model.decode(token, state)))
    return time.perf_counter() - start


def run(hf_dir: Path, text_path: Path, context: int | None, max_tokens: int | None,
        decode_tokens: int, rounds: int, as_json: bool) -> dict:
    from tqdm import tqdm

    from fermijit.engine import warm_up
    from fermijit.evaluate import DEFAULT_CONTEXT, read_text, score
    from fermijit.model.token_bytes import token_bytes
    import numba

    from fermijit.jit import cpu
    from fermijit.model import convert, quant_mix
    from fermijit.model.config import load_config
    from fermijit.model.forward import load_model
    from fermijit.model.tokenizer import Tokenizer

    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir() or convert.is_fermijit_model(hf_dir):
        raise FermijitError(f"{hf_dir}: bench quant takes an HF checkpoint directory (it "
                            f"converts it into each mix)")
    cfg = load_config(hf_dir)
    text = cfg.text_config
    tokens = Tokenizer(hf_dir, text.eos_token_id).encode(read_text(text_path))[:max_tokens]
    if tokens.size < 2:
        raise FermijitError(f"{text_path}: {tokens.size} token, nothing to predict")
    context = min(context or DEFAULT_CONTEXT, text.max_position_embeddings)

    def scored(model, label: str):
        warm_up(model, tokens, min(context, tokens.size - 1))
        with tqdm(total=tokens.size - 1, desc=f"eval {label}", unit="tok",
                  file=sys.stderr) as bar:
            return score(model, tokens, context, bar.update)

    report = {"source": str(hf_dir), "text": str(text_path), "tokens": int(tokens.size),
              "context": context, "threads": numba.get_num_threads(),
              "isa": cpu.decode_isa().label, "cpu": cpu.target_cpu_name(), "fp32": None}
    try:
        _, fp32 = load_model(hf_dir)
        report["fp32"] = scored(fp32, "fp32").as_dict()
        del fp32
    except FermijitError as e:  # too big for RAM unquantised: the mixes are compared alone
        print(f"fp32: {e}", file=sys.stderr)
    rows, models = [], {}
    with tempfile.TemporaryDirectory(prefix="fermijit-quant-") as tmp:
        for mix in quant_mix.MIXES:
            print(f"convert --quant {mix}", file=sys.stderr, flush=True)
            manifest = convert.convert(hf_dir, Path(tmp) / mix, mix=mix, show_progress=False)
            _, model = load_model(Path(tmp) / mix)
            result = scored(model, mix)
            per_token = token_bytes(model, [text.num_experts_per_tok] * len(model.layers))
            rows.append({"mix": mix, **result.as_dict(), "bytes_per_token": per_token.total,
                         "matrix_bits": _matrix_bits(manifest),
                         "file_bytes": (Path(tmp) / mix / convert.WEIGHTS).stat().st_size})
            models[mix] = model
        prompt = tokens[:DECODE_PROMPT]
        times: dict[str, list[float]] = {mix: [] for mix in models}
        for r in range(rounds):
            for mix, model in models.items():  # alternated: a drifting machine hits both
                times[mix].append(_decode_s(model, prompt, decode_tokens))
    for row in rows:
        row["decode_tok_s"] = decode_tokens / statistics.median(times[row["mix"]])
        row["decode_tok_s_rounds"] = [decode_tokens / t for t in times[row["mix"]]]
        if report["fp32"]:
            row["excess_nll"] = row["mean_nll"] - report["fp32"]["mean_nll"]
    report.update({"rows": rows, "decode_tokens": decode_tokens, "rounds": rounds})
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return report


def format_report(r: dict) -> str:
    fp32 = r["fp32"]
    lines = [f"{r['source']}: {r['tokens']} tokens of {r['text']} in windows of {r['context']}",
             f"cpu {r['cpu']}, decode isa {r['isa']}, {r['threads']} threads; decode "
             f"{r['decode_tokens']} tokens, median of {r['rounds']} alternating rounds",
             f"{'mix':<8} {'ppl':>9} {'NLL over fp32':>13} {'bytes/token':>12} "
             f"{'bits/weight':>11} {'file MB':>8} {'decode tok/s':>12}"]
    if fp32:
        lines.append(f"{'fp32':<8} {fp32['perplexity']:>9.3f} {'':>13} {'':>12} {32:>11.2f}")
    for row in r["rows"]:
        over = f"{row['excess_nll']:+.5f}" if "excess_nll" in row else "-"
        lines.append(f"{row['mix']:<8} {row['perplexity']:>9.3f} {over:>13} "
                     f"{row['bytes_per_token'] / 1e6:>10.3f}MB {row['matrix_bits']:>11.2f} "
                     f"{row['file_bytes'] / 1e6:>8.2f} {row['decode_tok_s']:>12.1f}")
    a, b = r["rows"]
    lines.append(f"{b['mix']} against {a['mix']}: perplexity "
                 f"{b['perplexity'] / a['perplexity'] - 1:+.2%}, bytes read per token "
                 f"{b['bytes_per_token'] / a['bytes_per_token'] - 1:+.2%}, decode tok/s "
                 f"{b['decode_tok_s'] / a['decode_tok_s'] - 1:+.2%} (this model)")
    if fp32 and a["excess_nll"] > 0:
        lines.append(f"NLL over fp32: {b['mix']}'s {b['excess_nll'] / a['excess_nll']:.2f}x "
                     f"{a['mix']}'s")
    return "\n".join(lines)
