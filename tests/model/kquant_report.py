"""Issue 34 item 1, by hand: what a user's Q4_K_M GGUF loses in fermijit, against llama.cpp on the
same file, the same tokens and the same windows.

    python -m tests.model.kquant_report LLAMA_CPP_DIR LIBLLAMA_SO WORKDIR [--threads N]

Two models, each scored on tests/model/data/heldout_sample.txt in non-overlapping windows of
`eval`'s (fermijit/evaluate.py: every token but the first predicted once, each window from an
empty state):
- the wide tiny model (tests/model/gguf_data.py WIDE: random weights, 256 wide so K-quants
  apply; its Q4_K_M is the shipped tests/model/data/gguf/wide-q4_k_m.gguf);
- the default model, exported as the fp32 checkpoint its shipped weights dequantise to
  (tests/model/gguf_report.py: its bf16 checkpoint is not kept), through llama.cpp's converter
  (F32 GGUF) and quantizer (Q4_K_M; tests/model/llama_quantize.py). Its matrices are 384 or 96
  wide, so llama.cpp's Q4_K_M falls back to Q5_0/Q5_1/Q8_0 for most of them (K-quants need rows
  of 256): the file's type counts are printed.
Rows: fermijit fp32 (the HF checkpoint, unquantised), llama.cpp on the F32 GGUF and on the
Q4_K_M GGUF (libllama, tests/model/llama_logits.py), fermijit on its import of the Q4_K_M GGUF
(model/gguf_convert.py: native where it can, else requantised; the tensor counts are printed),
and fermijit on the Q4_K_M's values with fp32 activations (the same weights, no 8-bit rounding
of the products' inputs): how much activation rounding alone moves the NLL, the scale against
which fermijit's and llama.cpp's NLL on the same file are compared (their activation rounding
differs in detail: llama.cpp's Q8_0 keeps fp16 scales, fermijit's fp32; its KV cache is fp16).
Columns: mean NLL (nats), perplexity, and against the fp32 row: mean KL(fp32 || row) per token
and the mean |NLL difference| per token; the last two against llama.cpp on the same GGUF: the
mean |NLL difference| per token, and the difference of the mean NLLs.
The random wide model's perplexity is near its vocabulary size by construction: its KL columns
are the figures that show quantisation error there.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SAMPLE = Path(__file__).parent / "data" / "heldout_sample.txt"
CONTEXT = 512  # fermijit/evaluate.py DEFAULT_CONTEXT


def windows(tokens: np.ndarray, context: int):
    """(inputs, targets) of each window, as fermijit/evaluate.py score cuts them."""
    inputs, targets = tokens[:-1], tokens[1:]
    for w0 in range(0, inputs.size, context):
        yield inputs[w0:w0 + context], targets[w0:w0 + context]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def fermijit_logprobs(model_dir, tokens: np.ndarray, context: int):
    """Per window: log-softmax [n, V] of fermijit's prefill (CPU) of that window; `model_dir` a
    model directory, or a GGUF file whose values run unquantised (fp32 weights and activations:
    gguf_convert.load_float_weights)."""
    from fermijit.model import gguf_convert
    from fermijit.model.forward import Model, load_model
    from fermijit.prefill.hybrid import CpuPrefiller

    if Path(model_dir).is_file():
        cfg, weights = gguf_convert.load_float_weights(model_dir)
        model = Model(cfg.text_config, weights)
    else:
        _, model = load_model(model_dir)
    prefiller = CpuPrefiller(model)
    for inputs, _ in windows(tokens, context):
        state = model.new_state(inputs.size)
        yield log_softmax(prefiller.prefill(inputs, state, all_logits=True))


def llama_logprobs(libllama: str, gguf: Path, tokens: np.ndarray, context: int, n_threads: int):
    from tests.model.llama_logits import LlamaModel

    m = LlamaModel(libllama, str(gguf), context, n_threads)
    try:
        for inputs, _ in windows(tokens, context):
            yield log_softmax(m.logits(inputs))
    finally:
        m.close()


def rows_of(name: str, logprobs, tokens: np.ndarray, context: int, ref=None):
    """(name, per-token nll [N-1], per-window log-probs kept when ref is None)."""
    nll, kept = [], []
    for lp, (_, targets) in zip(logprobs, windows(tokens, context)):
        nll.append(-lp[np.arange(targets.size), targets])
        kept.append(lp if ref is None else None)
        if ref is not None:
            kl_part = (np.exp(ref[len(nll) - 1]) * (ref[len(nll) - 1] - lp)).sum(axis=1)
            kept[-1] = kl_part
    return name, np.concatenate(nll), kept


def gguf_types(path: Path) -> str:
    from gguf import GGUFReader

    counts = collections.Counter(t.tensor_type.name for t in GGUFReader(path).tensors)
    return ", ".join(f"{n} {k}" for k, n in counts.most_common())


def report(title: str, hf: Path, ggufs: dict[str, Path], imports: dict[str, Path],
           tokenizer_dir: Path, libllama: str, n_threads: int, out: dict) -> None:
    """`imports`: fermijit runs by name (a model directory, or a GGUF run in fp32)."""
    from fermijit.model.tokenizer import Tokenizer
    from fermijit.model.config import load_config

    cfg = load_config(hf)
    context = min(CONTEXT, cfg.text_config.max_position_embeddings)
    tokens = Tokenizer(tokenizer_dir, cfg.text_config.eos_token_id).encode(SAMPLE.read_text())
    print(f"\n## {title}: {tokens.size} tokens, windows of {context}", flush=True)
    for name, path in ggufs.items():
        print(f"{name}: {path.stat().st_size / 2**20:.2f} MiB, {gguf_types(path)}")
    for name, path in imports.items():
        if path.is_file():
            continue
        manifest = json.loads((path / "fermijit.json").read_text())
        kinds = collections.Counter(t["quant"] for t in manifest["tensors"].values())
        requant = manifest["source"].get("requantised", {})
        print(f"{name}: {dict(kinds)}; {len(manifest['source']['imported_blocks'])} imported "
              f"bit for bit, {len(requant)} GGUF tensors requantised "
              f"({dict(collections.Counter(requant.values()))})")
    _, ref_nll, ref_lp = rows_of("fp32", fermijit_logprobs(hf, tokens, context), tokens, context)
    results = [("fermijit fp32 (HF checkpoint)", ref_nll, None)]
    llama_nll = {}
    for name, path in ggufs.items():
        label, nll, kl = rows_of(f"llama.cpp {name}", llama_logprobs(
            libllama, path, tokens, context, n_threads), tokens, context, ref_lp)
        llama_nll[name] = nll
        results.append((label, nll, np.concatenate(kl)))
    for name, path in imports.items():
        label, nll, kl = rows_of(f"fermijit {name}", fermijit_logprobs(path, tokens, context),
                                 tokens, context, ref_lp)
        results.append((label, nll, np.concatenate(kl)))
    print(f"{'run':<44} {'mean NLL':>9} {'ppl':>9} {'KL/tok':>9} {'|dNLL|':>8} "
          f"{'|d| llama':>9} {'d llama':>9}")
    rows = []
    for label, nll, kl in results:
        same = next((llama_nll[g] for g in llama_nll if label.startswith("fermijit")
                     and g in label), None)
        row = {"run": label, "mean_nll": float(nll.mean()), "ppl": float(np.exp(nll.mean())),
               "kl": None if kl is None else float(kl.mean()),
               "abs_dnll": float(np.abs(nll - ref_nll).mean()),
               "vs_llama": None if same is None else float(np.abs(nll - same).mean()),
               "mean_nll_minus_llama": None if same is None else float(nll.mean() - same.mean())}
        rows.append(row)
        kl_s = "-" if row["kl"] is None else f"{row['kl']:.5f}"
        vs = "-" if row["vs_llama"] is None else f"{row['vs_llama']:.5f}"
        d = "-" if same is None else f"{row['mean_nll_minus_llama']:+.5f}"
        print(f"{label:<44} {row['mean_nll']:>9.4f} {row['ppl']:>9.3f} {kl_s:>9} "
              f"{row['abs_dnll']:>8.5f} {vs:>9} {d:>9}", flush=True)
    out[title] = {"tokens": int(tokens.size), "context": context, "rows": rows}


def _to_gguf(llama_cpp: Path, hf: Path, dst: Path, pre: str) -> None:
    from tests.model.gguf_data import _CONVERT_PINNED

    pinned = _CONVERT_PINNED.replace('"qwen35"', f'"{pre}"')
    subprocess.run([sys.executable, "-c", pinned, str(llama_cpp), str(hf), "--outfile", str(dst),
                    "--outtype", "f32", "--no-mtp"], check=True, capture_output=True)


def main(argv: list[str]) -> None:
    from fermijit.model import convert
    from tests.model import gguf_data, gguf_report
    from tests.model.llama_quantize import quantize

    p = argparse.ArgumentParser()
    p.add_argument("llama_cpp", type=Path)
    p.add_argument("libllama")
    p.add_argument("work", type=Path)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    p.add_argument("--tag", default="native", help="names the imports in WORKDIR (a converter "
                   "change wants a new tag)")
    a = p.parse_args(argv)
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {}

    wide_hf = work / "wide-hf"
    if not wide_hf.exists():
        gguf_data.write_checkpoint(wide_hf, gguf_data.WIDE)
    wide_f32 = work / "wide-f32.gguf"
    if not wide_f32.exists():
        _to_gguf(a.llama_cpp, wide_hf, wide_f32, "qwen35")
    wide_import = work / f"fj-wide-q4_k_m-{a.tag}"
    if not wide_import.exists():
        convert.convert(gguf_data.Q4_K_M, wide_import, show_progress=False)
    report("wide tiny model (random)", wide_hf, {"F32": wide_f32, "Q4_K_M": gguf_data.Q4_K_M},
           {"Q4_K_M import": wide_import, "Q4_K_M values, fp32 activations": gguf_data.Q4_K_M},
           wide_hf, a.libllama, a.threads, out)

    hf = work / "default-hf"
    if not hf.exists():
        gguf_report.export_hf(hf)
    f32, q4km = work / "default-f32.gguf", work / "default-q4_k_m.gguf"
    if not f32.exists():
        _to_gguf(a.llama_cpp, hf, f32, "qwen2")  # the default tokenizer's split is Qwen2's
    if not q4km.exists():
        quantize(a.libllama, str(f32), str(q4km), "Q4_K_M", n_threads=a.threads)
    default_import = work / f"fj-default-q4_k_m-{a.tag}"
    if not default_import.exists():
        convert.convert(q4km, default_import, show_progress=False)
    report("default model", hf, {"F32": f32, "Q4_K_M": q4km},
           {"Q4_K_M import": default_import, "Q4_K_M values, fp32 activations": q4km}, hf,
           a.libllama, a.threads, out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
