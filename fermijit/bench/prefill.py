"""`python -m fermijit bench prefill`: the GPU prefill against its two floors, and its
projection onto a Tesla C2075.

One run measures, on the same GPU and host: the FMA ceiling (bench_gpu.fma_ceiling), the
host-to-device bandwidth from page-locked and from pageable memory, then the prefill of `--tokens`
random token ids with the experts streamed as planned (page-locked pool, or the staging ring past
--pin-budget) and from pageable memory (best of REPEATS each, on a fresh state). Floors:
PCIe = bytes copied / pinned bandwidth; compute = FLOPs / FMA ceiling (FLOPs counted from the
shapes and the run's routing, `flops`). The ratio is the planned run's time over the larger floor.
`--verbose` adds the per-layer copy / compute / overlap (CUDA events) and the per-category
profile (a separate run with a CUDA event between categories of kernels: the time from one event
to the next, on the GPU's clock).

`--project c2075`: the cost model `project` (stated in full in the output).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.ops import matvec
from fermijit.prefill import gpu_layout

REPEATS = 3
BANDWIDTH_BYTES = 256 << 20
SEED_C2075_S = 37.5          # the seed's published 947-token prefill on the C2075
SEED_C2075_BEFORE_S = 57.2   # ... before its optimisations


@dataclasses.dataclass(frozen=True)
class Device:
    """A GPU of the projection: fp32 FMA peak, memory bandwidth, pinned PCIe rate."""

    name: str
    fma_gflops: float
    memory_gbps: float
    pcie_gbps: float


C2075 = Device("Tesla C2075 (Fermi)", 1030.0, 144.0, 6.0)
PROJECTIONS = {"c2075": C2075}
# Categories bounded by memory traffic (no GEMM): projected through their achieved share of the
# measured device bandwidth; the rest through their achieved share of the FMA ceiling.
MEMORY_BOUND = ("small ops", "embedding", "act quant")
HOST = ("routing (host)", "copy wait")


def h2d_bandwidth(pinned: bool, nbytes: int = BANDWIDTH_BYTES) -> float:
    """GB/s of host-to-device copies of `nbytes` (median of 5), from page-locked or pageable
    memory, on a copy stream as the prefill does."""
    from fermijit.jit import gpu

    cuda = gpu.driver()
    host = gpu.pinned(nbytes) if pinned else np.ones(nbytes, np.uint8)
    host[:] = 1
    dev = gpu.empty((nbytes,), np.uint8)
    stream = gpu.copy_stream()
    times = []
    for _ in range(6):
        start, end = gpu.event(), gpu.event()
        start.record(stream)
        cuda.memcpy_htod_async(dev.gpudata, host, stream)
        end.record(stream)
        end.synchronize()
        times.append(start.time_till(end) / 1e3)
    return nbytes / float(np.median(times[1:])) / 1e9


def flops(model, n_tokens: int, start: int, layer_stats: list[dict]) -> dict[str, float]:
    """FLOPs of a prefill by category (2 per multiply-add), from the shapes and the routed slots
    each layer had (Pass.layer_stats)."""
    m, T = model, n_tokens
    H, D, Hq, Hkv = m.hidden, m.head_dim, m.n_heads, m.n_kv_heads
    Hv, dk, dv, C = m.n_value_heads, m.key_dim, m.value_dim, 64
    experts = m.layers[0].experts
    inter, shared_inter = experts.down_qs.shape[2] * 2, experts.shared_down_qs.shape[2] * 2
    out = dict.fromkeys(("dense gemm", "gated delta", "attention", "shared expert",
                         "expert gemm", "small ops", "lm head"), 0.0)
    n_chunks = -(-T // C)
    for is_attention, stats in zip(m.is_attention, layer_stats):
        if is_attention:
            out["dense gemm"] += 2 * T * H * (Hq * 2 * D + 2 * Hkv * D + Hq * D)
            out["attention"] += 2 * 2 * Hq * D * (T * start + T * (T + 1) / 2)
        else:
            out["dense gemm"] += 2 * T * H * (m.conv_dim + 2 * Hv * dv)
            out["gated delta"] += Hv * n_chunks * (4 * C * C * dk + 6 * C * dk * dv
                                                   + 4 * C * C * dv)
            out["small ops"] += 2 * T * H * 2 * Hv
        out["small ops"] += 2 * T * H * (m.n_experts + 1)
        out["shared expert"] += 2 * T * 3 * shared_inter * H
        out["expert gemm"] += 2 * stats["slots"] * 3 * inter * H
    out["lm head"] = 2 * m.vocab_size * H * (1 if isinstance(m.lm_head, matvec.Q4Matrix) else 2)
    return out


def memory_bytes(model, n_tokens: int, layer_stats: list[dict]) -> dict[str, float]:
    """Device memory traffic by category, approximately: weights read once per pass (4.5 bits a
    weight), activations read and written once per kernel (fp32); "act quant" is the 8-bit
    rounding of every GEMM input (gpu_prefill.Pass.rounded) when the run has it."""
    m, T, q4 = model, n_tokens, 18 / 32
    H, D, Hq, Hkv = m.hidden, m.head_dim, m.n_heads, m.n_kv_heads
    Hv, dv = m.n_value_heads, m.value_dim
    experts = m.layers[0].experts
    inter, shared_inter = experts.down_qs.shape[2] * 2, experts.shared_down_qs.shape[2] * 2
    out = dict.fromkeys(("dense gemm", "gated delta", "attention", "shared expert",
                         "expert gemm", "small ops", "embedding", "lm head", "act quant"), 0.0)
    for is_attention, stats in zip(m.is_attention, layer_stats):
        if is_attention:
            rows = Hq * 2 * D + 2 * Hkv * D
            out["dense gemm"] += q4 * H * (rows + Hq * D) + 4 * T * (2 * H + rows + Hq * D)
            out["attention"] += 4 * T * (4 * Hq * D + 2 * Hkv * D)
            out["small ops"] += 4 * T * (6 * Hq * D + 4 * Hkv * D)
            out["act quant"] += 8 * T * Hq * D
        else:
            rows = m.conv_dim + Hv * dv
            out["dense gemm"] += q4 * H * (rows + Hv * dv) + 4 * T * (2 * H + rows + Hv * dv)
            out["gated delta"] += 4 * T * (m.conv_dim + 2 * Hv * dv) + 4 * Hv * m.key_dim * dv
            out["small ops"] += 4 * T * (6 * m.conv_dim + 6 * Hv * dv)
            out["act quant"] += 8 * T * Hv * dv
        out["small ops"] += 4 * T * (6 * H + 2 * m.n_experts)
        out["shared expert"] += q4 * 3 * shared_inter * H + 4 * T * (3 * H + 4 * shared_inter)
        out["expert gemm"] += (stats["bytes"] + 4 * stats["slots"] * (2 * H + 2 * inter))
        out["act quant"] += 8 * (T * (2 * H + shared_inter) + stats["slots"] * inter)
    out["embedding"] = 4 * T * H
    out["lm head"] = gpu_layout.head_bytes(m)  # Q4_0, Q8_0 or GGUF blocks (a Q6_K head)
    return out


def profile_by_layer(run) -> list[dict[str, float]]:
    """Seconds per (layer, category) from a profiled Pass's marks; layer -1 the embedding, the
    last index the LM head."""
    marks = run.marks
    marks[-1][2].synchronize()
    n = len(run.m.layers) + 2
    out = [dict() for _ in range(n)]
    for (_, _, before), (layer, category, after) in zip(marks, marks[1:]):
        row = out[layer + 1]
        row[category] = row.get(category, 0.0) + before.time_till(after) / 1e3
    return out


def project(device: Device, by_layer: list[dict], layer_stats: list[dict], flops_by: dict,
            bytes_by: dict, h200_fma: float, h200_mem: float) -> dict:
    """The cost model of `bench prefill --project`, as its output states it."""
    total_h200 = {}
    for row in by_layer:
        for k, v in row.items():
            total_h200[k] = total_h200.get(k, 0.0) + v
    scale = {}  # projected seconds per measured second, per category
    for cat, t in total_h200.items():
        if cat in HOST or t <= 0:
            scale[cat] = 1.0
            continue
        f, b = flops_by.get(cat, 0.0), bytes_by.get(cat, 0.0)
        if cat in MEMORY_BOUND or f == 0:
            share = (b / t) / (h200_mem * 1e9)                       # of the device bandwidth
            projected = b / (share * device.memory_gbps * 1e9) if share else t
        else:
            share = (f / t) / (h200_fma * 1e9)                       # of the FMA ceiling
            projected = max(f / (share * device.fma_gflops * 1e9), b / (device.memory_gbps * 1e9))
        scale[cat] = projected / t
    layers = []
    for i, row in enumerate(by_layer):
        compute = sum(v * scale[k] for k, v in row.items() if k != "copy wait")
        stats = layer_stats[i - 1] if 1 <= i <= len(layer_stats) else None
        copy = stats["bytes"] / (device.pcie_gbps * 1e9) if stats else 0.0
        # A layer's experts are copied under the previous layer's post-routing work and its own
        # mixer (the prediction), about one layer of compute: the longer of the two.
        layers.append(max(compute, copy))
    return {"device": dataclasses.asdict(device), "seconds": sum(layers),
            "scale_by_category": scale, "h200_seconds_by_category": total_h200}


COST_MODEL = """cost model (--project): per category of kernels, FLOPs and bytes counted from the
shapes and this run's routing; GEMMs, attention and the GDN scan keep the share of the FMA
ceiling they reached here, applied to the target's fp32 peak, and take at least bytes / its memory
bandwidth; norms, conv, rope, router and copies between buffers (memory-bound) keep their share of
the device bandwidth measured here (copy.ptx), applied to the target's; host work (routing sort,
launches) is kept as measured on this host. Per layer the routed-expert copies move at the target's
PCIe rate and, as the schedule overlaps them (layer i+1's predicted experts copy under layer i's
experts and layer i+1's mixer), a layer takes the longer of its compute and its copies."""


def load(model_dir: Path | None, synthetic: str | None, err, kv=None):
    from fermijit.model.forward import load_model

    if (model_dir is None) == (synthetic is None):
        raise FermijitError("bench prefill needs exactly one of --model DIR, --synthetic NAME")
    if synthetic is not None:
        from fermijit.model import synth

        synth.config_for(synthetic)                  # the name's check
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        model_dir = root / f"fermijit-synth-{synthetic}"
        if not (model_dir / "fermijit.json").is_file():
            print(f"synthesising {synthetic} into {model_dir}", file=err, flush=True)
            print(synth.synth(synthetic, model_dir, show_progress=False).summary(), file=err)
    from fermijit.model.state import DEFAULT_KV

    return load_model(model_dir, kv=kv or DEFAULT_KV)[1]


def run(model_dir: Path | None, synthetic: str | None, n_tokens: int, gpu_mem: str | None,
        pin_budget: str | None, as_json: bool, verbose: bool, projection: str | None,
        out=None, err=None, kv=None) -> dict:
    from fermijit.bench import gpu as bench_gpu
    from fermijit.jit import gpu
    from fermijit.prefill import hybrid

    out, err = out or sys.stdout, err or sys.stderr
    if projection is not None and projection not in PROJECTIONS:
        raise FermijitError(f"--project: one of {', '.join(PROJECTIONS)}, got {projection!r}")
    budget, pins = hybrid.parse_bytes(gpu_mem), hybrid.parse_bytes(pin_budget)
    model = load(model_dir, synthetic, err, kv)
    reason = gpu.unavailable_reason()
    if reason is not None:
        raise FermijitError(f"bench prefill needs a GPU: {reason}")
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, n_tokens).astype(np.int32)
    fma, _ = bench_gpu.fma_ceiling()
    copy_gbps, _ = bench_gpu.copy_bandwidth()
    bw = {"pinned": h2d_bandwidth(True), "pageable": h2d_bandwidth(False)}
    report = {"model": str(model_dir or synthetic), "tokens": n_tokens, "fma_gflops": fma,
              "device_copy_gbps": copy_gbps, "h2d_gbps": bw, "runs": {}}
    for key, source in (("planned", None), ("pageable", "pageable")):
        free_before = gpu.memory()[0]
        pf = hybrid.GpuPrefiller(model, budget, pins, verbose=False, err=err, source=source)
        start = time.perf_counter()
        if not pf.prepare():
            raise FermijitError(f"the GPU prefill could not start: {pf.broken}")
        prepare_s = time.perf_counter() - start
        times, copied = [], 0
        for _ in range(REPEATS):
            state = model.new_state(n_tokens)
            before = pf.device.streamer.bytes_copied
            start = time.perf_counter()
            pf.run(tokens, state)
            times.append(time.perf_counter() - start)
            copied = pf.device.streamer.bytes_copied - before
        used = free_before - gpu.memory()[0]
        row = {"source": pf.device.streamer.source, "seconds": min(times), "times": times,
               "bytes_copied": copied,
               "prepare_s": prepare_s, "device_bytes_used": used, "plan": dataclasses.asdict(
                   pf.last_plan), "pinned_bytes": pf.device.streamer.pinned_bytes}
        stats = pf.last_pass.layer_stats
        row["host_s"] = dict(pf.last_pass.host_s)    # the last timed run's routing steps
        row["phases_s"] = dict(pf.last_phases)       # ... and its phases
        row["unused_experts"] = sum(s["unused_experts"] for s in stats)
        row["late_bytes"] = sum(s["late_bytes"] for s in stats)
        if key == "planned":
            pf.run(tokens, model.new_state(n_tokens), time_layers=True)
            row["layers"] = layer_rows(pf.last_pass)
            pf.run(tokens, model.new_state(n_tokens), profile=True)
            by_layer = profile_by_layer(pf.last_pass)
            f, b = flops(model, n_tokens, 0, stats), memory_bytes(model, n_tokens, stats)
            row["flops"], row["bytes"] = f, b
            row["profile"] = {k: sum(r.get(k, 0.0) for r in by_layer)
                              for k in sorted({k for r in by_layer for k in r})}
            if projection is not None:
                report["projection"] = project(PROJECTIONS[projection], by_layer, stats, f, b,
                                               fma, copy_gbps)
        report["runs"][key] = row
        del pf
    pinned = report["runs"]["planned"]
    pinned["pcie_floor_s"] = pinned["bytes_copied"] / (bw["pinned"] * 1e9)
    pinned["compute_floor_s"] = sum(pinned["flops"].values()) / (fma * 1e9)
    pinned["ratio_to_floor"] = pinned["seconds"] / max(pinned["pcie_floor_s"],
                                                       pinned["compute_floor_s"])
    if as_json:
        print(json.dumps(report, indent=1, default=float), file=out)
    else:
        print_report(report, verbose, out)
    return report


def sweep(model_dir: Path | None, synthetic: str | None, lengths: list[int], out=None,
          err=None, kv=None) -> list[dict]:
    """CPU against GPU prefill time per prompt length (best of REPEATS, kernels warm): where
    `--prefill auto` should switch (hybrid.AUTO_MIN_TOKENS)."""
    from fermijit.engine import warm_up
    from fermijit.prefill import hybrid

    out, err = out or sys.stdout, err or sys.stderr
    model = load(model_dir, synthetic, err, kv)
    gpu_pf = hybrid.GpuPrefiller(model, err=err)
    if not gpu_pf.prepare():
        raise FermijitError(f"the GPU prefill could not start: {gpu_pf.broken}")
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'tokens':>7}{'cpu s':>10}{'gpu s':>10}", file=out)
    for n in lengths:
        tokens = rng.integers(0, model.vocab_size, n).astype(np.int32)
        warm_up(model, tokens, n)
        best = {}
        for name, prefill in (("cpu", model.prefill), ("gpu", gpu_pf.run)):
            times = []
            for _ in range(REPEATS):
                state = model.new_state(n)
                start = time.perf_counter()
                prefill(tokens, state)
                times.append(time.perf_counter() - start)
            best[name] = min(times)
        rows.append({"tokens": n, "cpu_s": best["cpu"], "gpu_s": best["gpu"]})
        print(f"{n:>7}{best['cpu']:>10.4f}{best['gpu']:>10.4f}", file=out, flush=True)
    return rows


def layer_rows(run) -> list[dict]:
    """Per layer (CUDA events), in ms: its compute span, the span of its experts' copies, and how
    much of that copy ran under compute (its own layer's or the one before, where the prediction
    starts it)."""
    rows = []
    origin = run.timings[0].compute[0]
    origin.synchronize()
    run.timings[-1].compute[1].synchronize()
    spans = [tuple(origin.time_till(e) for e in t.compute) for t in run.timings]
    for i, t in enumerate(run.timings):
        c0, c1 = spans[i]
        k0, k1 = (origin.time_till(e) for e in t.copy) if t.copy else (c0, c0)
        under = spans[max(0, i - 1)][0], c1
        rows.append({"compute_ms": c1 - c0, "copy_ms": k1 - k0,
                     "overlap_ms": max(0.0, min(under[1], k1) - max(under[0], k0))})
    return rows


def print_report(r: dict, verbose: bool, out) -> None:
    p, g = r["runs"]["planned"], r["runs"]["pageable"]
    mib = 2 ** 20
    print(f"prefill {r['tokens']} tokens of {r['model']}; plan: {p['plan']['n_tokens']} tokens "
          f"in passes of <= {p['plan']['chunk']}, budget {p['plan']['budget'] / mib:,.0f} MiB, "
          f"device memory used {p['device_bytes_used'] / mib:,.0f} MiB", file=out)
    print(f"FMA ceiling {r['fma_gflops']:,.0f} GFLOP/s; host-to-device "
          f"{r['h2d_gbps']['pinned']:.1f} GB/s pinned, {r['h2d_gbps']['pageable']:.1f} GB/s "
          f"pageable", file=out)
    print(f"{'experts from':<14}{'prefill s':>10}{'tok/s':>9}{'copied GB':>11}", file=out)
    for name, row in ((p["source"], p), ("pageable", g)):
        print(f"{name:<14}{row['seconds']:>10.3f}{r['tokens'] / row['seconds']:>9.0f}"
              f"{row['bytes_copied'] / 1e9:>11.2f}", file=out)
    print(f"copies: {p['unused_experts']} experts prefetched and not routed (of "
          f"{len(p['layers'])} layers), {p['late_bytes'] / 1e6:,.1f} MB copied after routing "
          f"(missed by the prediction)", file=out)
    print(f"floors: PCIe {p['pcie_floor_s']:.3f} s (bytes / pinned bandwidth), compute "
          f"{p['compute_floor_s']:.3f} s ({sum(p['flops'].values()) / 1e9:,.0f} GFLOP / FMA "
          f"ceiling); {p['source']} time / larger floor = {p['ratio_to_floor']:.2f}", file=out)
    if verbose:
        print("per layer (ms): compute, copy, overlap", file=out)
        for i, row in enumerate(p["layers"]):
            print(f"  {i:>3} {row['compute_ms']:>8.2f} {row['copy_ms']:>8.2f} "
                  f"{row['overlap_ms']:>8.2f}", file=out)
        print("phases of the last timed run (host s): " + ", ".join(
            f"{k} {v:.4f}" for k, v in p["phases_s"].items()), file=out)
        print("host routing steps of the last timed run (s): " + ", ".join(
            f"{k} {v:.4f}" for k, v in p["host_s"].items()), file=out)
        print("profile (serialised run, s; GFLOP; GB):", file=out)
        for cat, s in p["profile"].items():
            print(f"  {cat:<24}{s:>9.4f}{p['flops'].get(cat, 0) / 1e9:>10.1f}"
                  f"{p['bytes'].get(cat, 0) / 1e9:>8.2f}", file=out)
    if "projection" in r:
        proj = r["projection"]
        print(COST_MODEL, file=out)
        print(f"projected {r['tokens']}-token prefill on the {proj['device']['name']} "
              f"({proj['device']['fma_gflops']:,.0f} GFLOP/s, {proj['device']['memory_gbps']:.0f}"
              f" GB/s, PCIe {proj['device']['pcie_gbps']:.0f} GB/s): {proj['seconds']:.2f} s "
              f"(the seed's published: {SEED_C2075_S} s, {SEED_C2075_BEFORE_S} s before its "
              f"optimisations)", file=out)
