"""`python -m fermijit bench isa`: how far the ISA variants' outputs are apart, and why (on
the full-size random model, avx2 and ssse3 logits after a 512-token prompt differed
by 10-13% while single products agreed to 1e-7).

The variants sum the same exact integer block products in a different order (16, 8 or 4 blocks
a step), so any two differ by fp32 rounding. Two measurements in one run:

1. One full-size layer of each kind (the model's first GDN and first attention layer, with its
   MoE), run by every ISA on the same normalised input over T tokens, against the float64 W4A8
   reference (model/reference.py): each sublayer's error, relative to its output's RMS.
2. The whole model, T tokens, last-position logits: every ISA against the best; and the best
   ISA against itself with the first layer's input-norm weights perturbed by a relative 1e-7
   (a rounding-sized change in one place). If the perturbed run moves the logits as far as
   another ISA does, the ISA difference is rounding amplified by the model, not a kernel error.

Each ISA runs in a process of its own (`--isa` fixes the variant before any kernel compiles).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from fermijit import FermijitError

PERTURBATION = 1e-7


def _rel(a, b) -> float:
    """max |a - b| / RMS(b)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.sqrt(np.mean(b * b)), 1e-30))


def _tokens(vocab: int, n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, n).astype(np.int32)


def _layer_outputs(model, cfg, weights, n_tokens: int) -> dict[str, np.ndarray]:
    """Each kind's first layer on one input x of `n_tokens` (1: the decode kernels; more: the
    prefill ones): the mixer's and the MoE's outputs, fermijit's and the float64 W4A8
    reference's."""
    from fermijit.model import reference as ref
    from fermijit.model.forward import Segment, Workspace
    from fermijit.model.state import KvCache, KvKind

    x = np.random.default_rng(1).standard_normal((n_tokens, model.hidden)).astype(np.float32)
    out = {}
    state = model.new_state(n_tokens)
    spec = ref.Reference(cfg, weights, quantize_activations=True,
                         quantize_kv=model.kv_kind is KvKind.Q8_0)  # the cache's rounding too
    ref_state = spec.new_state()
    for kind in ("gdn", "attention"):
        i = next(i for i, is_attn in enumerate(model.is_attention) if is_attn == (kind == "attention"))
        w, s = model.layers[i], state.layers[i]
        ws = Workspace(model, n_tokens)
        ws.tokens[:] = 0
        np.copyto(ws.xn, x)
        np.add(ws.offsets, 0, out=ws.positions)
        whole = [Segment(slice(0, n_tokens), 0)]
        if isinstance(s, KvCache):
            model.attention(w.mixer, w.joined_in, [s], whole, ws)
        else:
            model.gated_deltanet(w.mixer, w.joined_in, w.gates_in, [s], whole, ws)
        name = f"{kind} T{n_tokens}"
        out[f"{name} mixer"] = ws.y.copy()
        model.moe(w, ws)
        out[f"{name} moe"] = ws.y.copy()
        lw = spec.w.layers[i]
        x64 = x.astype(np.float64)
        out[f"{name} mixer ref"] = spec.mixer(x64, lw.mixer, ref_state.layers[i],
                                              np.arange(n_tokens))
        out[f"{name} moe ref"] = ref.moe(x64, lw.mlp, spec.top_k)
    return out


def _worker(isa: str, model_dir: str, n_tokens: int, n_layer_tokens: int, out_path: str,
            perturb: bool) -> None:
    """One process, one ISA: writes the arrays `run` compares."""
    from fermijit.jit import cpu

    # Decode too in `isa` (not DECODE_VARIANT's): each process is one variant throughout. Before
    # anything compiles (ssse3 switches the target to Westmere).
    cpu.select_isa(isa, isa)
    from fermijit.model.convert import load_converted
    from fermijit.model.forward import Model

    cfg, weights, _ = load_converted(model_dir)
    model = Model(cfg.text_config, weights)
    arrays = {}
    if not perturb:
        for n in (1, n_layer_tokens):
            arrays.update(_layer_outputs(model, cfg.text_config, weights, n))
    if perturb:
        first = model.layers[0]
        noise = np.random.default_rng(2).standard_normal(first.input_norm.shape)
        norm = ((1 + first.input_norm.astype(np.float64)) * (1 + PERTURBATION * noise) - 1)
        model.layers = (dataclasses.replace(first, input_norm=norm.astype(np.float32)),
                        *model.layers[1:])
    state = model.new_state(n_tokens)
    arrays["logits"] = model.prefill(_tokens(model.vocab_size, n_tokens), state).copy()
    np.savez(out_path, **arrays)


def run(model_dir: Path, n_tokens: int, n_layer_tokens: int, as_json: bool) -> None:
    import tempfile

    from fermijit.jit import cpu

    isas = [i.label for i in cpu.variants_up_to(cpu.selected_isa())]
    best = isas[0]
    with tempfile.TemporaryDirectory(prefix="fermijit-isa-") as tmp:
        results = {}
        for isa, perturb in [(i, False) for i in isas] + [(best, True)]:
            key = f"{isa} perturbed" if perturb else isa
            print(f"bench: {key}", file=sys.stderr, flush=True)
            path = str(Path(tmp) / f"{key.replace(' ', '-')}.npz")
            code = (f"from fermijit.bench.isa import _worker; _worker({isa!r}, "
                    f"{str(model_dir)!r}, {n_tokens}, {n_layer_tokens}, {path!r}, {perturb})")
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if r.returncode:
                raise FermijitError(f"bench isa: the {key} run failed: "
                                    f"{r.stderr.strip().splitlines()[-1:]}")
            with np.load(path) as z:
                results[key] = {k: z[k] for k in z.files}
    layer = {}
    for isa in isas:
        got = results[isa]
        layer[isa] = {name: _rel(got[name], got[name + " ref"]) for name in got
                      if name != "logits" and not name.endswith(" ref")}
    logits = {isa: _rel(results[isa]["logits"], results[best]["logits"]) for isa in isas[1:]}
    logits[f"{best} perturbed {PERTURBATION:g}"] = _rel(results[f"{best} perturbed"]["logits"],
                                                        results[best]["logits"])
    report = {"model": str(model_dir), "tokens": n_tokens, "layer_tokens": n_layer_tokens,
              "layer_vs_float64": layer, "logits_vs_" + best: logits}
    if as_json:
        print(json.dumps(report, indent=1))
        return
    print("one full-size layer of each kind (T1: decode kernels, T>1: prefill kernels): "
          "max |error| / RMS against the float64 W4A8 reference")
    names = list(next(iter(layer.values())))
    print(f"{'':<22}" + "".join(f"{isa:>14}" for isa in layer))
    for n in names:
        print(f"{n:<22}" + "".join(f"{layer[isa][n]:>14.2e}" for isa in layer))
    print(f"\nwhole model, logits at the last of {n_tokens} tokens: max |diff| / RMS against "
          f"{best}")
    for key, value in logits.items():
        print(f"  {key:<28} {value:.3e}")
