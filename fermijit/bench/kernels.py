"""`python -m fermijit bench kernels`: the CPU kernels against this machine's read bandwidth.

Everything is measured in one run and reported as ratios, because this class of machine is noisy
(±20-30 % between runs: notes §4). "Cold" weight sets are larger than the last-level cache
(>= 1 GiB by default) and are walked matrix by matrix, as decode walks a model's layers.
"""

from __future__ import annotations

import json
import math
import mmap
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from fermijit import FermijitError, machine
from fermijit.jit import cpu, simd
from fermijit.jit.simd import I8, I64, vec
from fermijit.ops import kquant, kquant_matvec, kquant_quantize, matvec, quant

GEMV_SHAPES = ((2048, 2048), (512, 2048), (4096, 2048))  # rows x K
# The GGUF block kinds whose decode GEMVs are measured beside Q4_0's (issue 34 item 4): a Q4_K_M
# file is mostly Q4_K, with Q6_K for the LM head and some down projections.
KQUANT_GEMVS = (kquant.Q4_K, kquant.Q6_K)
HOT_SHAPE = (2048, 2048)
HOT_WALKS = 20
LAUNCHES = 2000
# Prefill GEMMs, tokens x rows x K: dense projections over a 512-token pass, one reap128 expert's
# gate_up and down over its ~32 tokens, the default model's small K (shared expert, experts).
GEMM_SHAPES = ((512, 2048, 2048), (512, 8192, 2048), (32, 1024, 2048), (32, 2048, 512),
               (512, 768, 384), (64, 384, 96), (128, 512, 256))
REPEATS = 3  # best of: the least disturbed pass
PAIRS = 7    # bandwidth pass + GEMV walk pairs per shape and variant
PREFETCH_BYTES = 2048  # the read probe streams one long run: 1-2 KB ahead was best (notes §5)


def _make_read_probe(v: simd.Vec):
    """Stream bytes [start, stop) through 4 vector registers (xor, so nothing is computed that
    could bound the loop) with the same software prefetch as the GEMV."""
    step = 4 * v.nbytes

    @intrinsic
    def read_probe(typingctx, buf, start, stop):
        sig = types.int64(buf, start, stop)

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            start_v, stop_v = args[1], args[2]
            vty = vec(I64, v.nbytes // 8)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vty, None)) for _ in range(4)]
            n = builder.udiv(builder.sub(stop_v, start_v), ir.Constant(I64, step))
            with cgutils.for_range(builder, n) as loop:
                off = builder.add(start_v, builder.mul(loop.index, ir.Constant(I64, step)))
                for line in range(0, step, 64):
                    simd.prefetch(builder, data, builder.add(off, ir.Constant(
                        I64, PREFETCH_BYTES + line)))
                for j, acc in enumerate(accs):
                    x = simd.load(builder, data, builder.add(off, ir.Constant(I64, j * v.nbytes)),
                                  vec(I8, v.nbytes))
                    builder.store(builder.xor(builder.load(acc), builder.bitcast(x, vty)), acc)
            total = builder.xor(builder.xor(builder.load(accs[0]), builder.load(accs[1])),
                                builder.xor(builder.load(accs[2]), builder.load(accs[3])))
            return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))

        return sig, codegen

    return read_probe


def _read_body(buf, n_chunks):
    chunk = buf.size // n_chunks
    out = 0
    for c in prange(n_chunks):
        out += probe(buf, c * chunk, (c + 1) * chunk) & 1  # keeps the loads alive
    return out


def _progress(what: str) -> None:
    print(f"bench: {what}", file=sys.stderr, flush=True)


def _best_seconds(fn, repeats=REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@dataclass
class Row:
    what: str
    variant: str
    threads: int
    value: float
    unit: str
    ratio: float | None = None  # of the read bandwidth measured beside it, same threads


def _reader(isa):
    """The read probe for `isa`, as a function of the buffer: one streaming pass."""
    kernel = cpu.kernel(_read_body, parallel=True, variant=isa.label,
                        probe=_make_read_probe(simd.VEC_OF[isa]))
    return lambda buf: kernel(buf, numba.get_num_threads() * 8)


class ReadProbe:
    """The read probe over `nbytes` of ordinary pages at the selected ISA (bench decode's
    ceiling); `gbs` at the current thread count."""

    def __init__(self, nbytes: int):
        self.buf = _page_backed(nbytes)
        self.buf[:] = 1
        self.read = _reader(cpu.selected_isa())
        self.read(self.buf)

    def gbs(self, repeats: int = 1) -> float:
        """GB/s, best of `repeats` passes."""
        return self.buf.nbytes / _best_seconds(lambda: self.read(self.buf), repeats) / 1e9


def _page_backed(nbytes: int, huge: bool = False) -> np.ndarray:
    """Private anonymous memory in ordinary 4 KB pages, as a memory-mapped model file is, or in
    transparent huge pages where asked (numpy asks for them on any large array, which alone made
    cold GEMVs ~5 % faster here). The read probe and the weights it is compared with live in the
    same kind of memory."""
    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, np.uint8)[:nbytes]


def _fill(a: np.ndarray, values, chunk: int = 1 << 24) -> None:
    """a[:] = values(a.size), a chunk at a time (no GiB-sized temporaries)."""
    for start in range(0, a.size, chunk):
        part = a[start:start + chunk]
        part[:] = values(part.size)


def _cold_set(rows, k, nbytes, rng):
    """Distinct Q4_0 matrices totalling >= nbytes, laid out as a converted model file lays them
    out (every matrix's qs back to back, then every d: model/convert.py), prepared as decode
    holds them (matvec.Q4Matrix: checked once at load). Random bytes: the speed does not depend
    on the values, and quantising a GiB would take longer than the benchmark."""
    qs_bytes, d_count = rows * k // 2, rows * k // quant.BLOCK
    per = qs_bytes + 2 * d_count
    count = max(2, -(-nbytes // per))
    qs_all = _page_backed(count * qs_bytes)
    _fill(qs_all, lambda n: rng.integers(0, 256, n, dtype=np.uint8))
    d_all = _page_backed(count * d_count * 2).view(np.float16)
    _fill(d_all, lambda n: rng.uniform(0.001, 0.01, n))
    mats = [matvec.Q4Matrix.of(qs_all[i * qs_bytes:(i + 1) * qs_bytes].reshape(rows, k // 2),
                               d_all[i * d_count:(i + 1) * d_count].reshape(rows, -1))
            for i in range(count)]
    return mats, count * per


def _block_cold_set(fmt: kquant.Format, rows: int, k: int, nbytes: int, rng):
    """Distinct matrices of GGUF blocks totalling >= nbytes, back to back as a converted file
    lays them out: random bytes, and the fp16 scales the quantiser gives weights of a model's
    size (std 0.02): Q6_K's d is then below fp16's normal range, as in a real checkpoint, which
    code without F16C must convert without a denormal multiply (simd.fp16_to_f32)."""
    per = rows * fmt.n_bytes(k)
    count = max(2, -(-nbytes // per))
    flat = _page_backed(count * per)
    _fill(flat, lambda n: rng.integers(0, 256, n, dtype=np.uint8))
    view = flat.reshape(-1, fmt.block_bytes)
    sample = kquant_quantize.quantize_cpu(
        fmt, 0.02 * rng.standard_normal((64, k)).astype(np.float32)).reshape(-1, fmt.block_bytes)
    for offset in fmt.scale_offsets:
        scales = sample[:, offset:offset + 2]
        view[:, offset:offset + 2] = np.tile(scales, (-(-len(view) // len(scales)), 1))[:len(view)]
    return [flat[i * per:(i + 1) * per].reshape(rows, -1) for i in range(count)], count * per


def _kquant_gemv_rows(isas, n_all: int, nbytes: int, read, buf, rng) -> list[Row]:
    """The K-quant GEMVs cold, each walk paired with a read pass and with a Q4_0 walk of the same
    shape (their ratio: the same fraction of the read bandwidth is 1.0)."""
    rows_out = []
    r, k = GEMV_SHAPES[0]
    q4, q4_total = _cold_set(r, k, nbytes, rng)
    x = rng.standard_normal(k).astype(np.float32)
    y = np.empty(r, np.float32)
    for fmt in KQUANT_GEMVS:
        mats, total = _block_cold_set(fmt, r, k, nbytes, rng)
        act = kquant_matvec.quantize_for(fmt, x)
        for isa in isas:
            _progress(f"gemv {r}x{k} {fmt.name} {isa.label}")
            q4_act = matvec.quantize_act(x, isa)
            kquant_matvec.product(fmt, mats[0], act, y, isa)
            matvec.product(q4[0], q4_act, y, isa=isa)
            ratios, vs_q4, best = [], [], 0.0
            for _ in range(PAIRS):
                read_gbs = buf.nbytes / _best_seconds(lambda: read(buf), 1) / 1e9
                t = time.perf_counter()
                for w in mats:
                    kquant_matvec.product(fmt, w, act, y, isa)
                gbs = total / (time.perf_counter() - t) / 1e9
                t = time.perf_counter()
                for w in q4:
                    matvec.product(w, q4_act, y, isa=isa)
                q4_gbs = q4_total / (time.perf_counter() - t) / 1e9
                ratios.append(gbs / read_gbs)
                vs_q4.append(gbs / q4_gbs)
                best = max(best, gbs)
            rows_out.append(Row(f"gemv {r}x{k} cold {fmt.name}", isa.label, n_all, best, "GB/s",
                                float(np.median(ratios))))
            rows_out.append(Row(f"gemv {r}x{k} {fmt.name}/q4_0", isa.label, n_all,
                                float(np.median(vs_q4)), "ratio"))
        del mats
    return rows_out


def _westmere_rows(n_threads: int, gib: float) -> list[Row]:
    """The SSSE3 kernels as a Westmere runs them: Numba's target is fixed per process (notes,
    pitfall 2), so a child process compiled for `westmere` measures them, bandwidth included."""
    _progress("ssse3 compiled for westmere (child process)")
    child = subprocess.run(
        [sys.executable, "-m", "fermijit", "--isa", "ssse3", "bench", "kernels", "--json",
         "--threads", str(n_threads), "--gib", str(gib)],
        capture_output=True, text=True)
    if child.returncode != 0:
        raise FermijitError(f"the westmere-code benchmark failed: {child.stderr.strip()[-300:]}")
    rows = [Row(**row) for row in json.loads(child.stdout)["rows"]]
    for row in rows:
        row.variant = "ssse3/wsm"
    return [row for row in rows if row.what.startswith("gemv")]


# The bandwidth probe, the huge-page probe and a cold set are live at once.
SETS_AT_ONCE = 3


def run(as_json: bool, n_threads: int | None, gib: float) -> None:
    from fermijit.model.state import available_nbytes

    if not math.isfinite(gib):
        raise FermijitError(f"--gib must be a finite number, got {gib}")
    available = available_nbytes()
    if SETS_AT_ONCE * gib * 2**30 > available:
        raise FermijitError(f"--gib {gib:g} needs about {SETS_AT_ONCE * gib:g} GiB of memory, "
                            f"{available / 2**30:.1f} GiB is available")
    n_all = cpu.configure_threads(n_threads)
    threads_list = sorted({1, n_all})
    nbytes = int(gib * 2 ** 30)
    rng = np.random.default_rng(0)
    best_isa = cpu.selected_isa()
    isas = [i for i in cpu.variants_up_to(best_isa)]
    rows: list[Row] = []

    # This machine's bandwidth drifts between ~40 and ~80 GB/s within seconds (a shared host), so
    # each GEMV walk is paired with a bandwidth pass right before it and the ratio reported is
    # the median over the pairs: slow drift cancels within a pair, one lucky pass cannot count.
    buf = _page_backed(nbytes)
    buf[:] = 1
    read = _reader(best_isa)
    bw = {}
    for n in threads_list:
        _progress(f"read bandwidth, {n} thread(s)")
        numba.set_num_threads(n)
        read(buf)
        bw[n] = buf.nbytes / _best_seconds(lambda: read(buf)) / 1e9
    numba.set_num_threads(n_all)
    huge_gbs = None
    # For comparison only (the weights are in ordinary pages), and only where the kernel grants
    # huge pages, not just where they were asked for.
    _progress("read bandwidth, huge pages")
    huge = _page_backed(nbytes, huge=True)
    huge[:] = 1
    if machine.mapping_bytes(huge.ctypes.data, "AnonHugePages") >= huge.nbytes // 2:
        huge_gbs = huge.nbytes / _best_seconds(lambda: read(huge)) / 1e9
    del huge
    gemv_rows, pair_ratios = [], {isa: [] for isa in isas}
    for r, k in GEMV_SHAPES:
        mats, total = _cold_set(r, k, nbytes, rng)
        x = rng.standard_normal(k).astype(np.float32)
        y = np.empty(r, np.float32)
        for isa in isas:
            _progress(f"gemv {r}x{k} {isa.label}")
            act = matvec.quantize_act(x, isa)
            matvec.product(mats[0], act, y, isa=isa)
            ratios, best = [], 0.0
            for _ in range(PAIRS):
                read_gbs = buf.nbytes / _best_seconds(lambda: read(buf), 1) / 1e9
                t = time.perf_counter()
                for w in mats:
                    matvec.product(w, act, y, isa=isa)
                gbs = total / (time.perf_counter() - t) / 1e9
                bw[n_all] = max(bw[n_all], read_gbs)
                ratios.append(gbs / read_gbs)
                best = max(best, gbs)
            pair_ratios[isa] += ratios
            gemv_rows.append((r, k, isa, best, float(np.median(ratios))))
        del mats
    kquant_rows = _kquant_gemv_rows(isas, n_all, nbytes, read, buf, rng)
    del buf

    # The compute ceiling: the same products on weights already in cache (two matrices, ~5 MB,
    # within the L3 of this class of machine). A cold ratio cannot exceed hot / read bandwidth.
    r, k = HOT_SHAPE
    hot, hot_bytes = _cold_set(r, k, 0, rng)
    x = rng.standard_normal(k).astype(np.float32)
    y = np.empty(r, np.float32)
    hot_rows = []
    for isa in isas:
        _progress(f"gemv {r}x{k} hot {isa.label}")
        act = matvec.quantize_act(x, isa)

        def walk_hot():
            for _ in range(HOT_WALKS):
                for w in hot:
                    matvec.product(w, act, y, isa=isa)

        walk_hot()
        gbs = HOT_WALKS * hot_bytes / _best_seconds(walk_hot) / 1e9
        hot_rows.append(Row(f"gemv {r}x{k} hot", isa.label, n_all, gbs, "GB/s", gbs / bw[n_all]))
        # What a launch costs whatever its size (Python, dispatch, fork and join): the floor under
        # small matrices, and what grows with the team on many-core machines.
        one = matvec.Q4Matrix.of(*(a[:n_all] for a in (hot[0].qs, hot[0].d_bits.view(np.float16))))
        y_one = np.empty(n_all, np.float32)

        def launches():
            for _ in range(LAUNCHES):
                matvec.product(one, act, y_one, isa=isa)

        launches()
        hot_rows.append(Row(f"gemv launch ({n_all} rows)", isa.label, n_all,
                            _best_seconds(launches) / LAUNCHES * 1e6, "us"))
    for n, gbs in bw.items():
        rows.append(Row("read bandwidth (best)", best_isa.label, n, gbs, "GB/s", 1.0))
    if huge_gbs is not None:
        rows.append(Row("read bw, huge pages", best_isa.label, n_all, huge_gbs, "GB/s",
                        huge_gbs / bw[n_all]))
    for r, k, isa, gbs, ratio in gemv_rows:
        rows.append(Row(f"gemv {r}x{k} cold", isa.label, n_all, gbs, "GB/s", ratio))
    for isa, ratios in pair_ratios.items():
        # Bytes over time of the best walk of each shape: one decode-like mix of the three.
        walked = [(r * k * 9 / 16, gbs) for r, k, i, gbs, _ in gemv_rows if i is isa]
        mix_gbs = sum(b for b, _ in walked) / sum(b / g for b, g in walked)
        rows.append(Row("gemv all shapes", isa.label, n_all, mix_gbs, "GB/s",
                        float(np.median(ratios))))
    rows += kquant_rows
    rows += hot_rows

    for n_tok, r, k in GEMM_SHAPES:
        qs = rng.integers(0, 256, (r, k // 2), dtype=np.uint8)
        d = rng.uniform(0.001, 0.01, (r, k // quant.BLOCK)).astype(np.float16)
        x = rng.standard_normal((n_tok, k)).astype(np.float32)
        y = np.empty((n_tok, r), np.float32)
        for isa in isas:
            _progress(f"gemm {n_tok}x{r}x{k} {isa.label}")
            act = matvec.quantize_act(x, isa)
            matvec.cpu(qs, d, act, out=y, isa=isa)
            secs = _best_seconds(lambda: matvec.cpu(qs, d, act, out=y, isa=isa))
            rows.append(Row(f"gemm {n_tok}x{r}x{k}", isa.label, n_all,
                            2 * n_tok * r * k / secs / 1e9, "GFLOP/s"))

    if cpu.target_cpu_name() != cpu.WESTMERE:
        rows += _westmere_rows(n_all, gib)

    report = {"cpu": cpu.target_cpu_name(), "threads": n_all, "cold_set_bytes": nbytes,
              "rows": [asdict(row) for row in rows]}
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(f"cpu {report['cpu']}, {n_all} threads, cold sets of {nbytes / 2 ** 30:.2f} GiB")
    print(f"{'benchmark':<24} {'variant':<11} {'thr':>3} {'value':>9}  {'unit':<8} {'of read bw':>10}")
    for row in rows:
        ratio = "" if row.ratio is None else f"{100 * row.ratio:9.1f}%"
        print(f"{row.what:<24} {row.variant:<11} {row.threads:>3} {row.value:9.2f}  "
              f"{row.unit:<8} {ratio:>10}")
