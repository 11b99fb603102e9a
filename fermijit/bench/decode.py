"""`python -m fermijit bench decode`: a prompt, then N greedy tokens on a real-size model, against
this machine's read bandwidth measured in the same run.

Decode reads every weight a token needs once, and the KV cache's rows so far, so its ceiling is
read bandwidth / bytes per token. The bytes are counted from the model's own arrays: every dense
matrix, vector and the LM head, one embedding row, of the routed experts those the router
actually selected (watched on one extra token), the KV rows of the positions decoded at (on
average: prompt + half the tokens; at long context they are a real part), and the GDN layers'
recurrent state and conv window, which every token reads and writes back (reap128: 66 MB, 3 %).
Prefill is compute-bound: its GFLOP/s is compared with the W4A8 GEMM's own, measured here at the
prefill's shapes (a dense projection over the prompt; one expert over the tokens an expert gets on
average). `--profile` times a few more tokens op by op (fermijit/bench/profile.py),
and one more prefill of the prompt. `--threads-sweep` decodes again at each thread count given.

This machine's bandwidth drifts by tens of percent within minutes, so besides the ceiling from the
best probe before and after (`of_ceiling`), decode is also measured in windows of PAIR_TOKENS,
each against the best of PAIR_REPEATS probe passes run just before it (`of_ceiling_paired`: the
median of the windows' ratios), as bench kernels pairs its walks.
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
from fermijit.model.token_bytes import token_bytes

WARM_UP_PREFILL = 32   # tokens: past every op's parallel threshold (1 << 15 elements at H 2048)
PROBE_BYTES = 512 << 20  # read-bandwidth probe: >> the last-level cache, small beside the model
PROBE_REPEATS = 3
PROFILE_TOKENS = 3  # profiled tokens: the least disturbed one is shown (a shared machine)
PAIR_TOKENS = 16    # decode tokens a window of the paired measure
PAIR_REPEATS = 3    # probe passes before a window, the best counted: at 2 threads single passes
# right after decode tokens read 10-25 % below the rest (ratios over 100 %)
SWEEP_TOKENS = 32   # decode tokens at each count of --threads-sweep (two paired windows)


def _progress(what: str) -> None:
    print(f"bench: {what}", file=sys.stderr, flush=True)


# --- memory -------------------------------------------------------------------------------------

def memory_now() -> dict[str, int]:
    """Bytes: resident now, split anonymous / file-backed, and the peak (/proc/self/status)."""
    fields = {"VmHWM": "peak", "VmRSS": "rss", "RssAnon": "anon", "RssFile": "file",
              "RssShmem": "shmem"}
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            out[fields[key]] = int(value.split()[0]) * 1024
    return out


def page_ins() -> tuple[int, int]:
    """(major page faults, bytes read from storage) of this process so far: what re-reading
    evicted weight pages costs (/proc/self/stat field 12, /proc/self/io read_bytes)."""
    majflt = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[9])
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return majflt, int(io.get("read_bytes", 0))


class MemoryWatch:
    """The largest anonymous and file-backed residency seen at the samples taken (the kernel
    keeps a peak only of their sum, VmHWM)."""

    def __init__(self):
        self.anon = self.file = 0

    def sample(self) -> None:
        now = memory_now()
        self.anon = max(self.anon, now.get("anon", 0))
        self.file = max(self.file, now.get("file", 0) + now.get("shmem", 0))


# --- what a token reads (model/token_bytes.py counts the bytes) -----------------------------------

def watch_routing(model, token: int, state) -> list[int]:
    """Decode `token` with the MoE watched: distinct experts selected per layer."""
    selected = []

    def watched(w, xn, ids, weights):
        selected.append(int(np.unique(ids).size))

    model.moe_observer = watched
    try:
        model.decode(token, state)
    finally:
        model.moe_observer = None
    return selected


def matmul_flops_per_token(model) -> tuple[float, float]:
    """(dense, routed-expert) multiply-add FLOPs of one token's matrix products (2 per weight),
    the LM head excluded (prefill runs it for the last token only)."""
    from fermijit.ops import matvec

    dense = experts = 0.0
    for layer in model.layers:
        mats = [getattr(layer.mixer, f.name) for f in dataclasses.fields(layer.mixer)]
        dense += sum(2.0 * m.qs.shape[0] * m.qs.shape[1] * 2 for m in mats
                     if isinstance(m, matvec.Q4Matrix))
        dense += sum(2.0 * m.size for m in mats if isinstance(m, np.ndarray) and m.ndim == 2
                     and m.shape[1] == model.hidden)
        dense += 2.0 * layer.router.size
        gu, _, down, _ = layer.experts.routed
        per_expert = 2.0 * 2 * (gu[0].size + down[0].size)  # qs holds two weights per byte
        experts += model.top_k * per_expert
        sgu, _, sdown, _ = layer.experts.shared
        dense += 2.0 * 2 * (sgu.size + sdown.size)
    return dense, experts


def gdn_state_nbytes(state) -> int:
    """The GDN layers' state a decode token reads (and writes back): every GdnState's arrays."""
    from fermijit.model.state import GdnState

    return sum(s.nbytes for s in state.layers if isinstance(s, GdnState))


def gemm_gflops(model, n_tokens: int) -> dict[str, float]:
    """The W4A8 GEMM's GFLOP/s at the prefill's shapes, on the model's own layer-0 weights:
    a dense projection over `n_tokens`, and one expert's gate_up over the tokens an expert gets
    on average (n_tokens * top_k / experts)."""
    from fermijit.ops import matvec

    rng = np.random.default_rng(0)
    layer = model.layers[0]
    dense_w = max((getattr(layer.mixer, f.name) for f in dataclasses.fields(layer.mixer)),
                  key=lambda m: m.qs.size if isinstance(m, matvec.Q4Matrix) else -1)
    gu_qs, gu_d = layer.experts.routed[:2]
    expert_w = matvec.Q4Matrix.of(gu_qs[0], gu_d[0])
    per_expert = max(1, round(n_tokens * model.top_k / model.n_experts))
    out = {}
    for what, w, t in (("dense", dense_w, n_tokens), ("expert", expert_w, per_expert)):
        rows, k = w.qs.shape[0], 2 * w.qs.shape[1]
        act = matvec.quantize_act(rng.standard_normal((t, k)).astype(np.float32))
        y = np.empty((t, rows), np.float32)
        matvec.product(w, act, y)
        best = min(_seconds_per_call(lambda: matvec.product(w, act, y)) for _ in range(3))
        out[what] = 2 * t * rows * k / best / 1e9
        out[what + "_shape"] = [t, rows, k]
    return out


def _seconds_per_call(fn, min_s: float = 0.2) -> float:
    """Mean seconds of `fn()` over as many calls as fill `min_s` (at least 2)."""
    calls, start = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - start < min_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


class ProbeChild:
    """bench_cpu's read probe in a child process, on request, at this process's ISA and thread
    count: its buffer is the child's memory, so the peak RSS measured here is the model's own (an
    in-process probe was most of a small model's peak). This process waits while a pass runs."""

    def __init__(self, nbytes: int):
        import subprocess

        import numba

        from fermijit.jit import cpu

        self.process = subprocess.Popen(
            [sys.executable, "-c", "from fermijit.bench.decode import _probe_child; _probe_child()",
             cpu.selected_isa().label, str(numba.get_num_threads()), str(nbytes)],
            env=cpu.child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            self.close()
            raise FermijitError("bench decode: the read-probe process failed to start")

    def gbs(self, repeats: int = 1) -> float:
        """GB/s, best of `repeats` passes."""
        self.process.stdin.write(f"{repeats}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise FermijitError("bench decode: the read-probe process died")
        return float(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()

    def __enter__(self) -> "ProbeChild":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _probe_child() -> None:
    """ProbeChild's process: argv ISA, threads, bytes; a line of stdin is a number of passes,
    the best GB/s of them its answer."""
    isa, threads, nbytes = sys.argv[1:]
    from fermijit.jit import cpu

    cpu.select_isa(isa)
    cpu.configure_threads(int(threads))
    from fermijit.bench import kernels as bench_cpu

    probe = bench_cpu.ReadProbe(int(nbytes))
    print("ready", flush=True)
    for line in sys.stdin:
        print(probe.gbs(int(line)), flush=True)


# --- paired windows: this and bench longctx ------------------------------------------------------
# A ratio of two speeds measured minutes apart on a shared or drifting machine is noise (decode at
# 16k against 64 positions: 49 / 110 / 81 % in three runs of the GPU machine's host). So the two
# are measured in short windows taken in turn, and the median of each pair's ratio is reported.

def windows(n_tokens: int) -> list[range]:
    """The decode tokens in windows of about PAIR_TOKENS (one window when fewer)."""
    n = max(1, n_tokens // PAIR_TOKENS)
    return [range(i * n_tokens // n, (i + 1) * n_tokens // n) for i in range(n)]


def decode_tokens(model, state, token: int, n_tokens: int) -> tuple[list[float], int]:
    """Decode `n_tokens` greedy tokens from `token` into `state`: (each token's seconds, the last
    token)."""
    times = []
    for _ in range(n_tokens):
        start = time.perf_counter()
        token = int(np.argmax(model.decode(token, state)))
        times.append(time.perf_counter() - start)
    return times, token


def alternate(items, first, second, swap: bool = False) -> list[tuple]:
    """For each of `items`, first(item) then second(item): their results as pairs (first's,
    second's). `swap`: every other pair runs second first (A B B A ...), so a steady drift in the
    machine's speed favours neither."""
    pairs = []
    for i, item in enumerate(items):
        if swap and i % 2:
            b = second(item)
            pairs.append((first(item), b))
        else:
            a = first(item)
            pairs.append((a, second(item)))
    return pairs


def pair_ratios(pairs) -> list[float]:
    """second / first of each pair (speeds: the second's of the first's)."""
    return [b / a for a, b in pairs]


# --- the run ------------------------------------------------------------------------------------

def run(model_dir: Path | None, synthetic: str | None, n_prompt: int, n_tokens: int,
        n_threads: int | None, as_json: bool, profile: bool,
        sweep: tuple[int, ...] = (), sweep_tokens: int = SWEEP_TOKENS, kv=None, speculative=None,
        layers: int | None = None) -> dict:
    """`sweep`: thread counts at which decode is measured again after the main run (each
    `sweep_tokens` tokens in paired windows, then a profiled token: `--threads-sweep`); `kv` the
    KV cache's kind (default Q8_0); `speculative` (text file or None, prompts, drafts) measures
    speculative decoding against plain instead (fermijit/bench/speculative.py); `layers` cuts a
    synthetic model."""
    import numba

    from fermijit.jit import cpu
    from fermijit.model.state import DEFAULT_KV

    if (model_dir is None) == (synthetic is None):
        raise FermijitError("give one of --model DIR or --synthetic NAME")
    limit = numba.config.NUMBA_NUM_THREADS
    if any(not 1 <= n <= limit for n in sweep):
        raise FermijitError(f"--threads-sweep: counts must be between 1 and {limit} (Numba's "
                            f"threads here; NUMBA_NUM_THREADS raises it), got "
                            f"{','.join(map(str, sweep))}")
    threads = cpu.configure_threads(n_threads)
    report: dict = {"isa": cpu.selected_isa().label, "decode_isa": cpu.decode_isa().label,
                    "cpu": cpu.target_cpu_name(), "pinned": cpu.threads_pinned(),
                    "threads": threads, "prompt_tokens": n_prompt, "decode_tokens": n_tokens,
                    "sweep_threads": list(sweep), "sweep_tokens": sweep_tokens,
                    "kv_cache": (kv or DEFAULT_KV).value}

    def measure(directory: Path) -> dict:
        if speculative is None:
            return _measure(directory, report, as_json, profile)
        from fermijit.bench import speculative as bench_speculative

        return bench_speculative.run(directory, report, *speculative, as_json)

    if model_dir is not None:
        return measure(Path(model_dir))
    from fermijit.model import synth

    with tempfile.TemporaryDirectory(prefix="fermijit-synth-") as tmp:
        _progress(f"building {synthetic} in {tmp}")
        written = synth.synth(synthetic, Path(tmp) / synthetic, layers=layers)
        report["synthetic"] = {"name": synthetic, "layers": layers, "build_s": written.seconds,
                               "bytes": written.nbytes}
        return measure(written.path)


def _decode_windows(model, state, token: int, n_tokens: int, probe: ProbeChild):
    """Decode `n_tokens` greedy tokens in windows, each after a best-of-PAIR_REPEATS probe:
    (per-token seconds, the windows, each window's probe GB/s, CPU seconds, the last token)."""
    spans = windows(n_tokens)
    times, carried = [], {"token": token, "cpu_s": 0.0}

    def window(span):
        cpu0 = time.process_time()
        window_times, carried["token"] = decode_tokens(model, state, carried["token"], len(span))
        carried["cpu_s"] += time.process_time() - cpu0
        times.extend(window_times)

    pairs = alternate(spans, lambda _: probe.gbs(PAIR_REPEATS), window)
    return times, spans, [gbs for gbs, _ in pairs], carried["cpu_s"], carried["token"]


def _paired(total_bytes: int, times, spans, window_gbs) -> tuple[list, list]:
    """(each window's decode GB/s, its ratio to the probe before it)."""
    decode_gbs = [total_bytes * len(w) / sum(times[i] for i in w) / 1e9 for w in spans]
    return decode_gbs, pair_ratios(zip(window_gbs, decode_gbs))


def _profile(model, token: int, state) -> list[dict]:
    from fermijit.bench import profile as profiler

    return min((profiler.profile_token(model, token, state) for _ in range(PROFILE_TOKENS)),
               key=lambda rows: rows[-1]["ms"])


def _sweep(model, state, token: int, counts, n_tokens: int, total_bytes: int) -> list[dict]:
    """Decode at each thread count of `counts` (in order), paired with a probe of as many
    threads; each count's profiled token split by what its threads did (profile.split)."""
    from fermijit.jit import cpu

    rows = []
    main = cpu.configure_threads(None)
    try:
        for n in counts:
            cpu.configure_threads(n)
            _progress(f"sweep: {n} threads, {n_tokens} tokens")
            with ProbeChild(PROBE_BYTES) as probe:
                times, spans, window_gbs, _, token = _decode_windows(model, state, token,
                                                                     n_tokens, probe)
            decode_gbs, paired = _paired(total_bytes, times, spans, window_gbs)
            best = max(window_gbs)
            tok_s = len(times) / sum(times)
            profiled = _profile(model, token, state)[-1]
            rows.append({"threads": n, "tok_s": tok_s,
                         "token_ms_median": 1e3 * float(np.median(times)), "read_gbs": best,
                         "of_ceiling": tok_s * total_bytes / (best * 1e9),
                         "of_ceiling_paired": float(np.median(paired)),
                         "paired": paired, "profile_ms": profiled["ms"],
                         "python_ms": profiled["python_ms"], "split": profiled["split"]})
    finally:
        cpu.configure_threads(main)
    return rows


def _measure(model_dir: Path, report: dict, as_json: bool, profile: bool) -> dict:
    from fermijit import engine
    from fermijit.model.forward import load_model
    from fermijit.model.state import KvKind
    from fermijit.ops import moe

    memory = MemoryWatch()
    _progress("read bandwidth (before loading)")
    with ProbeChild(PROBE_BYTES) as probe:  # not alive during the load: its memory is not cache
        bw_before = probe.gbs(PROBE_REPEATS)
    memory.sample()

    start, cpu0 = time.perf_counter(), time.process_time()
    _, model = load_model(model_dir, kv=KvKind(report["kv_cache"]))
    load_s = time.perf_counter() - start
    load_cpu_s = time.process_time() - cpu0
    memory.sample()
    n_prompt, n_tokens = report["prompt_tokens"], report["decode_tokens"]
    if n_prompt + n_tokens + 1 + PROFILE_TOKENS > model.max_context:
        raise FermijitError(f"prompt plus tokens exceed the context of {model.max_context}")
    prompt = np.random.default_rng(0).integers(0, model.vocab_size, n_prompt).astype(np.int32)
    _progress(f"loaded in {load_s:.2f} s; warming up")
    cpu0 = time.process_time()
    warm_s = engine.warm_up(model, prompt, n_prefill=min(WARM_UP_PREFILL, n_prompt))
    warm_cpu_s = time.process_time() - cpu0
    memory.sample()

    _progress(f"prefill of {n_prompt} tokens")
    sweep = report["sweep_threads"]
    state = model.new_state(n_prompt + n_tokens + 1 + PROFILE_TOKENS
                            + len(sweep) * (report["sweep_tokens"] + PROFILE_TOKENS))
    start = time.perf_counter()
    token = int(np.argmax(model.prefill(prompt, state)))
    prefill_s = time.perf_counter() - start
    memory.sample()

    with ProbeChild(PROBE_BYTES) as probe:
        _progress(f"decode of {n_tokens} tokens")
        faults0 = page_ins()
        times, spans, window_gbs, decode_cpu_s, token = _decode_windows(model, state, token,
                                                                        n_tokens, probe)
        faults = [b - a for a, b in zip(faults0, page_ins())]
        memory.sample()
        peak = memory_now()["peak"]  # before anything else is allocated

        selected = watch_routing(model, token, state)
        bytes_ = token_bytes(model, selected, (n_prompt + n_tokens // 2) * state.position_nbytes,
                             gdn_state_nbytes(state))
        profile_rows = None
        if profile:
            _progress(f"profile of {PROFILE_TOKENS} tokens (the fastest is shown)")
            profile_rows = _profile(model, token, state)
        _progress("read bandwidth (after decode), W4A8 GEMM at the prefill shapes")
        bw = max(bw_before, probe.gbs(PROBE_REPEATS))
    prefill_profile = None
    if profile:
        from fermijit.bench import profile as profiler

        _progress(f"profile of a {n_prompt}-token prefill")
        prefill_profile = profiler.profile_prefill(model, prompt, model.new_state(n_prompt))
    sweep_rows = _sweep(model, state, token, sweep, report["sweep_tokens"], bytes_.total)
    # The prefill's GEMM figures are the Q4_0 GEMM's: none for a model of block-kind experts
    is_q4_0 = isinstance(model.layers[0].experts, moe.MoeWeights)
    gemm = gemm_gflops(model, n_prompt) if is_q4_0 else None

    decode_s = sum(times)
    tok_s = n_tokens / decode_s
    ceiling = bw * 1e9 / bytes_.total
    paired_gbs, paired = _paired(bytes_.total, times, spans, window_gbs)
    dense_f, expert_f = matmul_flops_per_token(model) if is_q4_0 else (np.nan, np.nan)
    prefill_gflops = (dense_f + expert_f) * n_prompt / prefill_s / 1e9
    ideal_s = (n_prompt * (dense_f / gemm["dense"] + expert_f / gemm["expert"]) / 1e9
               if gemm else np.nan)
    file_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    report.update({
        "model": str(model_dir), "model_file_bytes": file_bytes,
        # CPU seconds of the process (all threads): on a shared machine the wall times include
        # waiting for a core; these do not.
        "load_s": load_s, "load_cpu_s": load_cpu_s, "warm_up_s": warm_s,
        "warm_up_cpu_s": warm_cpu_s, "decode_cpu_s": decode_cpu_s, "ready_to_decode_s": load_s + warm_s,
        "first_token_s": load_s + warm_s + prefill_s,
        "prefill_s": prefill_s, "prefill_tok_s": n_prompt / prefill_s,
        "prefill_gflops": prefill_gflops, "gemm_gflops": gemm,
        "prefill_of_gemm": ideal_s / prefill_s,
        "decode_tok_s": tok_s, "decode_token_ms_median": 1e3 * float(np.median(times)),
        "bytes_per_token": dataclasses.asdict(bytes_) | {"total": bytes_.total},
        "experts_selected_per_layer": selected,
        "read_gbs": bw, "ceiling_tok_s": ceiling, "of_ceiling": tok_s / ceiling,
        "paired": {"window_tokens": [len(w) for w in spans],
                   "probe_gbs": window_gbs, "decode_gbs": paired_gbs, "of_ceiling": paired},
        "of_ceiling_paired": float(np.median(paired)),
        "decode_gbs": bytes_.total * tok_s / 1e9,
        "decode_major_faults": faults[0], "decode_read_bytes": faults[1],
        "peak_rss": peak, "peak_anon": memory.anon, "peak_file": memory.file,
        "profile": profile_rows, "prefill_profile": prefill_profile, "sweep": sweep_rows,
    })
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return report


def format_report(r: dict) -> str:
    gb, gib = 1e9, 2 ** 30
    b = r["bytes_per_token"]
    g = r["gemm_gflops"]
    lines = [f"model {r['model']} ({r['model_file_bytes'] / gb:.2f} GB)"]
    if "synthetic" in r:
        s = r["synthetic"]
        lines.append(f"  synthetic {s['name']}, built in {s['build_s']:.1f} s "
                     f"({s['bytes'] / gb / s['build_s']:.2f} GB/s)")
    lines += [
        f"cpu {r['cpu']}, isa {r['isa']} (decode {r['decode_isa']}), {r['threads']} threads",
        f"{'load':<28} {r['load_s']:9.2f} s  (CPU {r['load_cpu_s']:.2f} s)",
        f"{'kernel warm-up':<28} {r['warm_up_s']:9.2f} s  (CPU {r['warm_up_cpu_s']:.2f} s)",
        f"{'ready to decode':<28} {r['ready_to_decode_s']:9.2f} s",
        f"{'load to first token':<28} {r['first_token_s']:9.2f} s  (prefill included)",
        f"{'prefill':<28} {r['prefill_tok_s']:9.2f} tok/s  ({r['prompt_tokens']} tokens, "
        f"{r['prefill_gflops']:.1f} GFLOP/s)",
    ]
    if g:  # the Q4_0 GEMM's (bench decode measures it on Q4_0 experts only)
        lines += [
            f"{'  W4A8 GEMM, dense':<28} {g['dense']:9.1f} GFLOP/s  (T x R x K "
            f"{g['dense_shape']})",
            f"{'  W4A8 GEMM, one expert':<28} {g['expert']:9.1f} GFLOP/s  "
            f"(T x R x K {g['expert_shape']})",
            f"{'  prefill of GEMM':<28} {100 * r['prefill_of_gemm']:9.1f} %"]
    lines += [
        f"{'decode':<28} {r['decode_tok_s']:9.2f} tok/s  ({r['decode_tokens']} tokens, median "
        f"{r['decode_token_ms_median']:.1f} ms; CPU {r['decode_cpu_s']:.2f} s)",
        f"{'bytes per token':<28} {b['total'] / gb:9.3f} GB  (dense {b['dense'] / gb:.3f}, "
        f"experts {b['experts'] / gb:.3f}, lm head {b['lm_head'] / gb:.3f}, embedding row "
        f"{b['embedding']} B, KV {b['kv'] / gb:.3f}: {r['kv_cache']}, GDN state "
        f"{b.get('state', 0) / gb:.3f})",
        f"{'read bandwidth':<28} {r['read_gbs']:9.2f} GB/s",
        f"{'decode reads':<28} {r['decode_gbs']:9.2f} GB/s",
        f"{'bandwidth ceiling':<28} {r['ceiling_tok_s']:9.2f} tok/s",
        f"{'decode of ceiling':<28} {100 * r['of_ceiling']:9.1f} %",
        f"{'  paired with the probe':<28} {100 * r['of_ceiling_paired']:9.1f} %  (median of "
        f"{len(r['paired']['of_ceiling'])} windows: "
        + ", ".join(f"{100 * x:.0f}" for x in r["paired"]["of_ceiling"]) + ")",
        f"{'decode page-ins':<28} {r['decode_major_faults']:9d}     "
        f"({r['decode_read_bytes'] / gb:.2f} GB read from storage)",
        f"{'peak RSS':<28} {r['peak_rss'] / gib:9.2f} GiB  (anonymous {r['peak_anon'] / gib:.2f}, "
        f"file-backed {r['peak_file'] / gib:.2f})",
    ]
    if r.get("profile"):
        from fermijit.bench import profile as profiler

        lines.append(profiler.format_rows(r["profile"]))
    if r.get("prefill_profile"):
        from fermijit.bench import profile as profiler

        lines.append(profiler.format_rows(r["prefill_profile"],
                                          f"a {r['prompt_tokens']}-token prefill"))
    if r.get("sweep"):
        lines.append(format_sweep(r["sweep"], r["sweep_tokens"]))
    return "\n".join(lines)


def format_sweep(rows: list[dict], n_tokens: int) -> str:
    """The threads sweep: speed against the ceiling, and a profiled token's time split (ms)."""
    lines = [f"threads sweep ({n_tokens} tokens each; split of one profiled token, ms: Python "
             f"and dispatch, kernels outside the fork regions, and in the regions work, threads "
             f"idle, fork/join)",
             f"{'threads':>7} {'tok/s':>7} {'ms':>7} {'GB/s':>6} {'ceil %':>6} {'paired':>6} "
             f"{'token':>7} {'python':>7} {'serial':>7} {'work':>7} {'idle':>7} {'fork':>7} "
             f"{'regions':>7}"]
    for r in rows:
        s = r["split"]
        lines.append(f"{r['threads']:>7} {r['tok_s']:7.2f} {r['token_ms_median']:7.1f} "
                     f"{r['read_gbs']:6.1f} {100 * r['of_ceiling']:6.1f} "
                     f"{100 * r['of_ceiling_paired']:6.1f} {r['profile_ms']:7.2f} "
                     f"{r['python_ms']:7.2f} {s['serial']:7.2f} {s['work']:7.2f} "
                     f"{s['idle']:7.2f} {s['fork_join']:7.2f} {s['regions']:7d}")
    return "\n".join(lines)
