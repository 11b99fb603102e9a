"""`python -m fermijit bench gpu [--json]`: the GPU kernels against what the card can do.

First two ceilings, both measured with Fermi-ISA PTX so they bound what this code can reach:
the fp32 FMA throughput (kernels_ptx/fma_probe.ptx) and the device copy bandwidth
(kernels_ptx/copy.ptx, and the driver's memcpy for comparison). Then each kernel at the real
model's prefill shapes: T tokens (1024); dense Q4_0 GEMMs 2048 -> 8192 (in_proj_qkv)
and 4096 -> 2048 (out_proj); routed experts with 128 experts (REAP) and T*8/128 tokens each
(balanced routing, 64 at T = 1024); the K-quant GEMMs (Q4_K, Q5_K, Q6_K:
kernels_ptx/kquant_gemm.ptx) at the same shapes beside Q4_0's. GEMMs are quoted as a fraction of
the FMA ceiling, memory-bound kernels as a fraction of the copy bandwidth. Times are medians of
CUDA-event timings after a warm-up launch. Benchmarks are commands, never timed tests (DESIGN.md,
Testing).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass

import numpy as np

from fermijit.jit import gpu

REPEATS = 10
FMA_CHAINS, FMA_UNROLL = (8, 16), 16
FMA_ITERATIONS = 2048
FMA_BLOCKS_PER_SM = 32
COPY_BYTES = 256 << 20
HIDDEN, EXPERT_INTER, N_EXPERTS, TOP_K = 2048, 512, 128, 8
DENSE_SHAPES = ((2048, 8192, "in_proj_qkv"), (4096, 2048, "out_proj"))


@dataclass
class Row:
    kernel: str
    shape: str
    time_us: float
    rate: float        # GFLOP/s or GB/s
    unit: str
    ceiling_fraction: float  # of the FMA ceiling (GEMMs) or of the copy bandwidth


def median_seconds(launch, repeats: int = REPEATS) -> float:
    """Median over `repeats` of one `launch()`, timed by CUDA events, after one warm-up."""
    cuda = gpu.driver()
    start, end = cuda.Event(), cuda.Event()
    launch()
    times = []
    for _ in range(repeats):
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.time_till(end) / 1e3)
    return statistics.median(times)


def fma_ceiling() -> tuple[float, str]:
    """Best GFLOP/s of the FMA probe over its variants."""
    cuda = gpu.driver()
    device = cuda.Context.get_device()
    n_blocks = device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT) * FMA_BLOCKS_PER_SM
    out = gpu.gpuarray().empty(n_blocks * 256, np.float32)
    best = (0.0, "")
    for chains in FMA_CHAINS:
        probe = gpu.kernel("fma_probe", CHAINS=chains, UNROLL=FMA_UNROLL)
        seconds = median_seconds(lambda: probe((n_blocks,), (256,), out, FMA_ITERATIONS,
                                               0.999999, 1e-7))
        flops = 2 * chains * FMA_UNROLL * FMA_ITERATIONS * n_blocks * 256
        best = max(best, (flops / seconds / 1e9, f"CHAINS={chains}"))
    if not np.isfinite(out.get()).all():
        raise AssertionError("fma_probe produced non-finite values")
    return best


def copy_bandwidth() -> tuple[float, float]:
    """GB/s (bytes read + written) of copy.ptx and of the driver's device-to-device memcpy."""
    cuda = gpu.driver()
    ga = gpu.gpuarray()
    src = ga.to_gpu(np.arange(COPY_BYTES // 4, dtype=np.float32))
    dst = ga.empty_like(src)
    copy = gpu.kernel("copy")
    n_vec = COPY_BYTES // 16
    n_blocks = min(65535, -(-n_vec // 256))
    kernel_s = median_seconds(lambda: copy((n_blocks,), (256,), dst, src, n_vec))
    if not np.array_equal(dst.get()[::4096], src.get()[::4096]):
        raise AssertionError("copy.ptx copied wrong values")
    memcpy_s = median_seconds(lambda: cuda.memcpy_dtod(dst.gpudata, src.gpudata, COPY_BYTES))
    return 2 * COPY_BYTES / kernel_s / 1e9, 2 * COPY_BYTES / memcpy_s / 1e9


def random_q4(rng, shape: tuple[int, ...]):
    """Random Q4_0 weights (qs, d) [..., rows, K] on the device, without an fp32 copy."""
    *lead, k = shape
    qs = rng.integers(0, 256, (*lead, k // 2), dtype=np.uint8)
    d = (rng.random((*lead, k // 32), dtype=np.float32) * 0.02 + 0.001).astype(np.float16)
    ga = gpu.gpuarray()
    return ga.to_gpu(qs), ga.to_gpu(d)


def random_blocks(rng, kind: str, shape: tuple[int, ...]):
    """Random GGUF blocks of `kind` [..., rows, K/Q·S] on the device (ops/kquant.py FORMATS),
    every block's fp16 scales small and finite."""
    from fermijit.ops import kquant

    fmt = kquant.FORMATS[kind]
    *lead, k = shape
    blocks = rng.integers(0, 256, (*lead, fmt.n_bytes(k)), dtype=np.uint8)
    view = kquant.block_view(fmt, blocks)
    for offset in fmt.scale_offsets:
        view[..., offset:offset + 2] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
    return gpu.gpuarray().to_gpu(blocks)


# The K-quant GEMMs (issue 34: kernels_ptx/kquant_gemm.ptx) beside Q4_0's at the same shapes.
KQUANT_KINDS = ("q4_k", "q5_k", "q6_k")


def gemm_rows(rng, n_tokens: int, fma_gflops: float) -> list[Row]:
    ga = gpu.gpuarray()
    rows = []
    for k, n, name in DENSE_SHAPES:
        x = ga.to_gpu(rng.standard_normal((n_tokens, k), dtype=np.float32))
        qs, d = random_q4(rng, (n, k))
        y = ga.empty((n_tokens, n), np.float32)
        dense = gpu.kernel("q4_gemm", MODE="dense")
        seconds = median_seconds(lambda: dense((-(-n // 128), -(-n_tokens // 64)), (256,),
                                               x, qs, d, y, None, None, None, n_tokens, n, k))
        gflops = 2 * n_tokens * n * k / seconds / 1e9
        rows.append(Row(f"q4_gemm dense ({name})", f"T{n_tokens} {k}->{n}", seconds * 1e6,
                        gflops, "GFLOP/s", gflops / fma_gflops))
        for kind in KQUANT_KINDS:
            blocks = random_blocks(rng, kind, (n, k))
            kernel = gpu.kernel("kquant_gemm", MODE="dense", FORMAT=kind)
            seconds = median_seconds(lambda: kernel((-(-n // 128), -(-n_tokens // 64)), (256,),
                                                    x, blocks, None, y, None, None, None,
                                                    n_tokens, n, k))
            gflops = 2 * n_tokens * n * k / seconds / 1e9
            rows.append(Row(f"kquant_gemm {kind} dense ({name})", f"T{n_tokens} {k}->{n}",
                            seconds * 1e6, gflops, "GFLOP/s", gflops / fma_gflops))
    return rows


def expert_rows(rng, n_tokens: int, fma_gflops: float) -> list[Row]:
    from fermijit.ops import expert_matmul

    ga = gpu.gpuarray()
    # Balanced routing: token t takes experts 8t .. 8t+7 (mod 128), T*8/128 slots per expert.
    ids = ((np.arange(n_tokens)[:, None] * TOP_K + np.arange(TOP_K)) % N_EXPERTS).astype(np.int32)
    weights = np.full((n_tokens, TOP_K), 1 / TOP_K, np.float32)
    x = ga.to_gpu(rng.standard_normal((n_tokens, HIDDEN), dtype=np.float32))
    gate_up = random_q4(rng, (N_EXPERTS, 2 * EXPERT_INTER, HIDDEN))
    down = random_q4(rng, (N_EXPERTS, HIDDEN, EXPERT_INTER))
    routing = expert_matmul.route(ids, weights, N_EXPERTS)
    n_slots = n_tokens * TOP_K
    h = ga.empty((n_slots, EXPERT_INTER), np.float32)
    y = ga.zeros((n_tokens, HIDDEN), np.float32)
    per_expert = f"E{N_EXPERTS}x{n_slots // N_EXPERTS}"
    gate_up_s = median_seconds(lambda: expert_matmul.gate_up_gpu(x, routing, *gate_up, h))
    down_s = median_seconds(lambda: expert_matmul.down_gpu(h, routing, *down, y))
    whole_s = median_seconds(lambda: expert_matmul.gpu(x, ids, weights, *gate_up, *down, out=y))
    gate_up_flops = 2 * n_slots * 2 * EXPERT_INTER * HIDDEN
    down_flops = 2 * n_slots * HIDDEN * EXPERT_INTER
    rows = []
    for name, shape, seconds, flops in (
            ("q4_gemm expert_gate_up+SwiGLU", f"{per_expert} {HIDDEN}->2x{EXPERT_INTER}",
             gate_up_s, gate_up_flops),
            ("q4_gemm expert_down+scatter", f"{per_expert} {EXPERT_INTER}->{HIDDEN}",
             down_s, down_flops),
            ("expert_matmul.gpu (route+both)", f"T{n_tokens} top{TOP_K}", whole_s,
             gate_up_flops + down_flops)):
        gflops = flops / seconds / 1e9
        rows.append(Row(name, shape, seconds * 1e6, gflops, "GFLOP/s", gflops / fma_gflops))
    from fermijit.ops import kquant_gemm

    for kind in KQUANT_KINDS:
        gu_blocks = random_blocks(rng, kind, (N_EXPERTS, 2 * EXPERT_INTER, HIDDEN))
        dn_blocks = random_blocks(rng, kind, (N_EXPERTS, HIDDEN, EXPERT_INTER))
        for name, shape, seconds, flops in (
                (f"kquant_gemm {kind} expert_gate_up", f"{per_expert} {HIDDEN}->2x{EXPERT_INTER}",
                 median_seconds(lambda: kquant_gemm.gate_up_gpu(kind, x, routing, gu_blocks, h)),
                 gate_up_flops),
                (f"kquant_gemm {kind} expert_down", f"{per_expert} {EXPERT_INTER}->{HIDDEN}",
                 median_seconds(lambda: kquant_gemm.down_gpu(kind, h, routing, dn_blocks, y)),
                 down_flops)):
            gflops = flops / seconds / 1e9
            rows.append(Row(name, shape, seconds * 1e6, gflops, "GFLOP/s", gflops / fma_gflops))
    return rows


def layer_op_rows(rng, n_tokens: int, fma_gflops: float, copy_gbps: float,
                  only: tuple[str, ...] = ()) -> list[Row]:
    """The other prefill ops at the model's shapes, each through its public `gpu(...)` on device
    arrays (so no host copies, except the small tables some launchers make: RoPE's cos/sin,
    the embedding's and router's checks). Memory-bound ops against the copy bandwidth (bytes
    read once plus written), compute-bound ones against the FMA ceiling. `only`: measure just
    the kernels whose name contains one of these strings (all when empty)."""
    from fermijit.ops import attention, conv1d, embedding, gated_delta, l2norm, rmsnorm, rope
    from fermijit.ops import router

    ga = gpu.gpuarray()
    T = n_tokens

    def normal(*shape):
        return ga.to_gpu(rng.standard_normal(shape, dtype=np.float32))

    def wanted(name):
        return not only or any(o in name for o in only)

    def bandwidth_row(name, shape, launch, nbytes):
        if not wanted(name):
            return None
        seconds = median_seconds(launch)
        return Row(name, shape, seconds * 1e6, nbytes / seconds / 1e9, "GB/s",
                   nbytes / seconds / 1e9 / copy_gbps)

    def compute_row(name, shape, launch, flops):
        if not wanted(name):
            return None
        seconds = median_seconds(launch)
        return Row(name, shape, seconds * 1e6, flops / seconds / 1e9, "GFLOP/s",
                   flops / seconds / 1e9 / fma_gflops)

    vocab = 248320 // 8  # an eighth of the real table keeps the bench's memory small
    table = ga.to_gpu(rng.standard_normal((vocab, HIDDEN), dtype=np.float32).astype(np.float16))
    ids = rng.integers(0, vocab, T).astype(np.int32)
    x, w = normal(T, HIDDEN), normal(HIDDEN)
    embedded = ga.empty((T, HIDDEN), np.float32)
    o, z, w_head = normal(T, 32, 128), normal(T, 32, 128), normal(128)
    qk = normal(T, 16, 128)
    q_attn = normal(T, 16, 256)
    positions = np.arange(T, dtype=np.int64)
    mixed, conv_w, conv_state = normal(T, 8192), normal(8192, 4), normal(8192, 3)
    logits = normal(T, N_EXPERTS)
    k_cache, v_cache, gate = normal(2, T, 256), normal(2, T, 256), normal(T, 16, 256)
    unit = 1 / np.sqrt(128)
    gdn_q, gdn_k = (ga.to_gpu((rng.standard_normal((T, 16, 128)) * unit).astype(np.float32))
                    for _ in range(2))
    gdn_v = normal(T, 32, 128)
    gdn_g = ga.to_gpu(-rng.random((T, 32), dtype=np.float32) * 0.1)
    gdn_beta = ga.to_gpu(rng.random((T, 32), dtype=np.float32))
    gdn_state = ga.zeros((32, 128, 128), np.float32)
    out_h, out_heads, out_attn = (ga.empty_like(a) for a in (x, o, q_attn))
    out_qk, out_mixed = ga.empty_like(qk), ga.empty_like(mixed)
    out_gdn = ga.empty_like(gdn_v)
    routed = (ga.empty((T, TOP_K), np.int32), ga.empty((T, TOP_K), np.float32))
    # Causal attention: T(T+1)/2 query-key pairs, 2 flops each for q.k and for p.v per dim.
    attention_flops = 2 * 2 * 16 * 256 * T * (T + 1) // 2
    # The chunked GDN per (head, chunk of 64): K K^T and Q K^T (2 C^2 dk each), the scan's K S,
    # Q S and state update (2 C dk dv each), Ab B and Mqk V' (2 C^2 dv each, done in full).
    n_chunks = -(-T // 64)
    gdn_flops = 32 * n_chunks * (2 * 2 * 64 * 64 * 128 + 3 * 2 * 64 * 128 * 128
                                 + 2 * 2 * 64 * 64 * 128)
    # The chunked GDN's two kernels apart (issue 31 item 4: which one holds the time): prep over
    # all chunks (K K^T, Q K^T, the inversion), then the scan alone on prep's scratch.
    gdn_scratch = gated_delta.gpu_scratch(T, 32)
    gdn_prep_flops = 32 * n_chunks * 2 * 2 * 64 * 64 * 128
    rows = [
        bandwidth_row("embedding f16", f"T{T} H{HIDDEN}",
                      lambda: embedding.gpu(ids, table, out=embedded),
                      T * HIDDEN * (2 + 4)),
        bandwidth_row("rmsnorm", f"T{T} D{HIDDEN}",
                      lambda: rmsnorm.gpu(x, w, 1e-6, out=out_h), T * HIDDEN * 8),
        bandwidth_row("gated rmsnorm", f"T{T} Hv32 dv128",
                      lambda: rmsnorm.gated_gpu(o, z, w_head, 1e-6, out=out_heads),
                      T * 32 * 128 * 12),
        bandwidth_row("l2norm", f"T{T} H16 d128",
                      lambda: l2norm.gpu(qk, 1e-6, unit, out=out_qk), T * 16 * 128 * 8),
        bandwidth_row("rope (q, R64)", f"T{T} H16 D256",
                      lambda: rope.gpu(q_attn, positions, 64, 1e7, out=out_attn),
                      T * 16 * 256 * 8),
        bandwidth_row("conv1d+silu", f"T{T} C8192 K4",
                      lambda: conv1d.gpu(mixed, conv_w, conv_state, out=out_mixed),
                      T * 8192 * 8),
        bandwidth_row("router top8", f"T{T} E{N_EXPERTS}",
                      lambda: router.gpu(logits, TOP_K, out=routed), T * N_EXPERTS * 4),
        compute_row("attention (causal, gated)", f"T{T} Hq16 Hkv2 D256",
                    lambda: attention.gpu(q_attn, k_cache, v_cache, gate, 0, out=out_attn),
                    attention_flops),
        compute_row("attention, flash (issue 31)", f"T{T} Hq16 Hkv2 D256",
                    lambda: attention.flash_gpu(q_attn, k_cache, v_cache, gate, 0,
                                                out=out_attn), attention_flops),
        compute_row("gated delta chunked", f"T{T} Hv32 dk128 dv128",
                    lambda: gated_delta.gpu(gdn_q, gdn_k, gdn_v, gdn_g, gdn_beta, gdn_state,
                                            out=out_gdn), gdn_flops),
        compute_row("gated delta prep (of chunked)", f"T{T} Hv32 dk128 C64",
                    lambda: gated_delta.gpu_prep(gdn_q, gdn_k, gdn_g, gdn_beta, gdn_scratch, T,
                                                 16, 32, 128), gdn_prep_flops),
        compute_row("gated delta scan (of chunked)", f"T{T} Hv32 dk128 dv128",
                    lambda: gated_delta.gpu_scan(gdn_q, gdn_k, gdn_v, gdn_scratch, gdn_state,
                                                 out_gdn, T, 16, 32, 128, 128),
                    gdn_flops - gdn_prep_flops),
    ]
    return [r for r in rows if r is not None]


def run(as_json: bool = False, n_tokens: int = 1024, only: tuple[str, ...] = ()) -> None:
    """The table (or JSON); `only`: just the layer ops whose name contains one of these strings,
    no GEMMs (the ceilings are measured all the same)."""
    cuda = gpu.driver()
    device = cuda.Context.get_device()
    rng = np.random.default_rng(0)
    print(f"device: {device.name()}", file=sys.stderr)
    fma_gflops, fma_variant = fma_ceiling()
    copy_gbps, memcpy_gbps = copy_bandwidth()
    rows = [] if only else (gemm_rows(rng, n_tokens, fma_gflops)
                            + expert_rows(rng, n_tokens, fma_gflops))
    rows += layer_op_rows(rng, n_tokens, fma_gflops, copy_gbps, only)
    if as_json:
        print(json.dumps({"device": device.name(), "fma_gflops": fma_gflops,
                          "fma_variant": fma_variant, "copy_gbps": copy_gbps,
                          "memcpy_dtod_gbps": memcpy_gbps, "tokens": n_tokens,
                          "kernels": [asdict(r) for r in rows]}, indent=1))
        return
    print(f"FMA ceiling (fma_probe.ptx, {fma_variant}): {fma_gflops:,.0f} GFLOP/s")
    print(f"copy bandwidth: copy.ptx {copy_gbps:,.0f} GB/s, memcpy_dtod {memcpy_gbps:,.0f} GB/s")
    width = max(len(r.kernel) for r in rows)
    shape_width = max(len(r.shape) for r in rows)
    print(f"{'kernel':<{width}}  {'shape':<{shape_width}}  {'time us':>9}  {'rate':>12}  "
          f"{'of ceiling':>10}")
    for r in rows:
        print(f"{r.kernel:<{width}}  {r.shape:<{shape_width}}  {r.time_us:>9.1f}  "
              f"{r.rate:>8,.0f} {r.unit:<7}  {r.ceiling_fraction:>9.1%}")
