"""`python -m fermijit ...`: one click group, one subcommand per verb. Commands validate, call one
engine function and print; heavy imports (numba, pycuda, the model) happen inside commands so that
`--help` is instant. Library code raises FermijitError; `main` turns it into a one-line error."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import click

from fermijit import CORE_MODULES, FermijitError, __version__, missing_dependency

ISA_CHOICES = ("ssse3", "avx2", "avx512vnni")


class ByteSize(click.ParamType):
    """A number of bytes: 1000000, 512K, 64M, 2G (powers of 1024)."""

    name = "size"
    UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().upper().removesuffix("B").removesuffix("I")
        number, unit = (text[:-1], text[-1]) if text[-1:] in self.UNITS else (text, "")
        try:
            nbytes = float(number) * self.UNITS[unit]
        except ValueError:
            nbytes = -1.0
        if not 0 <= nbytes < float("inf"):  # inf, 1e300T: int() raised OverflowError
            self.fail(f"{value!r} is not a size such as 512M or 2G", param, ctx)
        return int(nbytes)


SIZE = ByteSize()


class CountList(click.ParamType):
    """Comma-separated positive integers, e.g. 1,2,4,8,16."""

    name = "counts"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            counts = tuple(int(part) for part in str(value).split(","))
        except ValueError:
            counts = ()
        if not counts or min(counts) < 1:
            self.fail(f"{value!r} is not a list of positive counts such as 1,2,4", param, ctx)
        return counts


THREAD_COUNTS = CountList()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="fermijit",
                      message="%(prog)s %(version)s")
@click.option("--isa", type=click.Choice(ISA_CHOICES), envvar="FERMIJIT_ISA", default=None,
              help="CPU kernel variant (default: the best this CPU has; env FERMIJIT_ISA). "
                   "ssse3 also compiles for a Westmere target.")
@click.option("--decode-isa", type=click.Choice(ISA_CHOICES), envvar="FERMIJIT_DECODE_ISA",
              default=None,
              help="CPU kernel variant of decode's one-token products (default: avx2 where "
                   "--isa is avx512vnni, measured faster for decode; else --isa's).")
@click.option("--pin-threads", is_flag=True, envvar="FERMIJIT_PIN_THREADS",
              help="Bind kernel thread t to physical core t (env FERMIJIT_PIN_THREADS; default: "
                   "unbound, so threads can move off a core other work loads).")
def cli(isa: str | None, decode_isa: str | None, pin_threads: bool) -> None:
    """fermijit: Qwen3.6-35B-A3B in 4 bits on a Westmere CPU and a Fermi GPU."""
    from fermijit.jit import cpu

    cpu.select_isa(isa, decode_isa)
    if pin_threads:
        cpu.pin_threads()


def _select_numa(ctx, param, value):
    from fermijit.host import numa

    numa.select(value)
    return value


# model/convert.py LM_HEAD_CHOICES (not imported: the CLI's start stays light)
lm_head_option = click.option(
    "--lm-head", type=click.Choice(["q8_0", "q6_k", "q4_0"]), default=None,
    help="Quantisation of the output head, the matrix most sensitive to error (28 % of a "
         "full-size token's bytes in q8_0): q8_0 as before, q4_0 the smallest [default: q6_k, "
         "llama.cpp's choice; q8_0 where its rows are not whole 256-blocks].")
SYNTHETIC_NAMES = click.Choice(["qwen3.6-35b-a3b", "qwen3.6-35b-a3b-reap128"])  # model/synth.py
synthetic_option = click.option(
    "--synthetic", type=SYNTHETIC_NAMES, default=None,
    help="Build this synthetic model into a temporary directory first (when no --model is given).")

def full_size_options(command):
    """--model DIR or --synthetic NAME, kept in /dev/shm (bench prefill, bench longctx)."""
    command = click.option(
        "--synthetic", default=None,
        help="A synthetic full-size model (python -m fermijit synth), made in /dev/shm when "
             "absent: qwen3.6-35b-a3b or qwen3.6-35b-a3b-reap128.")(command)
    return click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
                        help="A fermijit model directory.")(command)


threads_option = click.option("--threads", type=click.IntRange(min=1), default=None,
                              help="Numba threads (default: the physical cores).")
json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print JSON instead of the table.")

numa_option = click.option(
    "--numa", type=click.Choice(["interleave", "rows", "local", "off"]), default=None,
    callback=_select_numa, expose_value=False,
    help="NUMA placement of the weight pages (default: interleave where there are several "
         "nodes, else off; rows: interleave, then each bound thread's rows of the dense "
         "matrices on its node, with --pin-threads).")


def _int_list(flag: str, text: str) -> list[int]:
    """'8,32,128' -> [8, 32, 128], each >= 1; else a one-line usage error."""
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise click.BadParameter(f"{flag} takes positive integers like 8,32,128, got {text!r}")
    return values


def draft_option(command):
    """--draft, --draft-vocab (fermijit/speculative.py Drafts), for generate, serve and bench."""
    for option in reversed((
            click.option("--draft", type=click.IntRange(min=1), default=1, show_default=True,
                         help="With --speculative mtp: tokens the MTP head drafts per step (more "
                              "chain the head on its own output; at most 8)."),
            click.option("--draft-vocab", type=click.IntRange(min=1), default=None,
                         help="With --speculative mtp: draft from the first N token ids only "
                              "(the most frequent: a cheaper draft LM head; default all)."))):
        command = option(command)
    return command


def _drafts(speculative: str, draft: int, draft_vocab: int | None):
    """speculative.Drafts for --speculative mtp (and auto), None for none."""
    if speculative == "none":
        if draft != 1 or draft_vocab is not None:  # asked for drafts that would never be made
            raise click.UsageError("--draft and --draft-vocab need --speculative mtp")
        return None
    from fermijit.speculative import Drafts

    return Drafts(draft, draft_vocab)


def prefill_options(command):
    """--prefill, --gpu-mem, --pin-budget, --verbose (fermijit/prefill/hybrid.py), for generate,
    eval, serve and prune."""
    for option in reversed((
            click.option("--prefill", "prefill", type=click.Choice(["cpu", "gpu", "auto"]),
                         default="auto", show_default=True,
                         help="Where the prompt is prefilled: the GPU streams the experts from "
                              "host memory; auto takes the GPU for long prompts."),
            click.option("--gpu-mem", default=None, help="GPU memory the GPU prefill may use, "
                                                         "e.g. 6G (default: free memory less "
                                                         "512 MiB)."),
            click.option("--pin-budget", default=None,
                         help="Page-locked host memory for the experts, e.g. 16G (default: half "
                              "the RAM); past it a staging ring."),
            click.option("--verbose", is_flag=True,
                         help="Print the GPU prefill's memory plan on stderr."))):
        command = option(command)
    return command


# model/image.py DEFAULT_MAX_IMAGE_TOKENS (not imported here: --help stays instant)
DEFAULT_MAX_IMAGE_TOKENS = 2048
max_image_tokens_option = click.option(
    "--max-image-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_IMAGE_TOKENS,
    show_default=True,
    help="Most image tokens a prompt's images may make (from their sizes, checked before they "
         "are decoded: the vision tower's work grows with them).")


kv_option = click.option(
    "--kv-cache", "kv_cache", type=click.Choice(["q8_0", "f32"]), default="q8_0",
    show_default=True, help="The KV cache: Q8_0 (8-bit blocks of 32 along the head dim: a "
                            "quarter of fp32's memory and reads) or f32.")


def _kv(kv_cache: str):
    from fermijit.model.state import KvKind

    return KvKind(kv_cache)


def cache_options(command):
    """--no-cache, --cache-dir, --cache-mem, --snapshot-every (fermijit/cache/prefix_cache.py), for
    generate and serve."""
    for option in reversed((
            click.option("--no-cache", is_flag=True, help="Prefill the whole prompt: no "
                                                          "snapshot prefix cache."),
            click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
                         default=None, envvar="FERMIJIT_CACHE_DIR",
                         help="Keep prompt snapshots in this directory too, so later runs (and "
                              "other processes) resume from them (env FERMIJIT_CACHE_DIR; never "
                              "pruned)."),
            click.option("--cache-mem", type=SIZE, default=None,
                         help="Most memory the snapshot cache holds, e.g. 512M, 2G (default: "
                              "1/8 of RAM)."),
            click.option("--snapshot-every", type=click.IntRange(min=1), default=None,
                         help="Snapshot the state every this many prompt tokens (default: "
                              "256)."),
            click.option("--cache-key", default=None, envvar="FERMIJIT_CACHE_KEY",
                         help="Sign the snapshots written to --cache-dir with this secret "
                              "(HMAC-SHA256) and use only those it signed (env "
                              "FERMIJIT_CACHE_KEY): for a directory others can write."))):
        command = option(command)
    return command


def _cache_settings(no_cache: bool, cache_dir: Path | None, cache_mem: int | None,
                    snapshot_every: int | None, cache_key: str | None):
    from fermijit.cache import prefix_cache

    if cache_key == "":
        raise click.BadParameter("--cache-key is empty")
    return prefix_cache.CacheSettings(
        is_enabled=not no_cache, mem_bytes=cache_mem, directory=cache_dir,
        snapshot_every=snapshot_every or prefix_cache.SNAPSHOT_EVERY,
        key=None if cache_key is None else cache_key.encode())


@cli.command()
@threads_option
def info(threads: int | None) -> None:
    """CPU, SIMD features, kernel variants, threading, GPU and ptxas availability."""
    from fermijit import machine

    for key, value in machine.describe(threads):
        click.echo(f"{key + ':':<22} {value}")


@cli.group()
def bench() -> None:
    """Benchmarks: print a table, and JSON with --json."""


@bench.command("kernels")
@json_option
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Numba threads for the all-threads columns (default: the physical cores).")
@click.option("--gib", type=click.FloatRange(min=0.0625), default=1.0, show_default=True,
              help="Size of each cold weight set and of the bandwidth probe, in GiB.")
def bench_kernels(as_json: bool, threads: int | None, gib: float) -> None:
    """Read bandwidth, each GEMV variant's weight GB/s on cold weights, CPU-prefill GEMM GFLOP/s."""
    from fermijit.bench import kernels as bench_cpu

    bench_cpu.run(as_json=as_json, n_threads=threads, gib=gib)


@bench.command("isa")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), required=True,
              help="A fermijit model directory (a full-size synthetic one: `synth`).")
@click.option("--tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prompt tokens through the whole model.")
@click.option("--layer-tokens", type=click.IntRange(min=2), default=8, show_default=True,
              help="Tokens through the single layers in the prefill kernels' row.")
@json_option
def bench_isa(model_dir: Path, tokens: int, layer_tokens: int, as_json: bool) -> None:
    """How far apart the ISA variants' outputs are: one layer of each kind against the float64
    reference, and the whole model's logits, with a 1e-7 perturbation for scale."""
    from fermijit.bench import isa as isa_bench

    isa_bench.run(model_dir, tokens, layer_tokens, as_json)


@bench.command("decode")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="A fermijit model directory.")
@synthetic_option
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Random prompt tokens to prefill.")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Greedy tokens to decode.")
@threads_option
@numa_option
@json_option
@click.option("--profile", is_flag=True, help="Also time one more token op by op (Python and "
                                              "dispatch apart from kernel time).")
@click.option("--threads-sweep", "sweep", type=THREAD_COUNTS, default=None,
              help="Then decode again at each of these thread counts, e.g. 1,2,4,8,16: tok/s, "
                   "of the ceiling (paired), a profiled token's split (kernels, fork/join, idle).")
@click.option("--sweep-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Tokens decoded at each count of --threads-sweep.")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="With --synthetic: only the first N layers (a slice of the full size).")
@click.option("--speculative", type=click.Choice(["none", "mtp"]), default="none",
              show_default=True,
              help="mtp: speculative decoding with the MTP head against plain decoding, same "
                   "prompts (tok/s, tokens per step, acceptance, bytes per accepted token, step "
                   "costs, the projection at 0.7-0.8 acceptance).")
@draft_option
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="With --speculative: prompts from windows of this text.")
@click.option("--prompts", "n_prompts", type=click.IntRange(min=1), default=4, show_default=True,
              help="With --speculative: prompts decoded each way.")
@kv_option
def bench_decode(model_dir: Path | None, synthetic: str | None, prompt_tokens: int, tokens: int,
                 threads: int | None, as_json: bool, profile: bool, sweep: tuple | None,
                 sweep_tokens: int, layers: int | None, speculative: str, draft: int,
                 draft_vocab: int | None, text_path: Path | None, n_prompts: int,
                 kv_cache: str) -> None:
    """Prefill a prompt, decode N tokens: tok/s, weight bytes per token, read bandwidth and the
    ceiling it implies, prefill against the W4A8 GEMM, peak RSS, load-to-first-token time."""
    from fermijit.bench import decode as bench_decode_module

    if model_dir is not None:
        synthetic = None
    bench_decode_module.run(model_dir, synthetic, prompt_tokens, tokens, threads, as_json, profile,
                            sweep or (), sweep_tokens, _kv(kv_cache),
                            (text_path, n_prompts, _drafts(speculative, draft, draft_vocab))
                            if speculative == "mtp" else None,
                            layers)


@bench.command("llama-cpp")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), required=True,
              help="A fermijit model directory.")
@click.option("--gguf", type=click.Path(path_type=Path), required=True,
              help="The same model as GGUF (`fermijit export MODEL FILE`).")
@click.option("--llama-bench", "llama_bench", type=click.Path(path_type=Path), required=True,
              help="llama.cpp's llama-bench binary.")
@click.option("--threads", type=THREAD_COUNTS, default=None,
              help="Thread counts, e.g. 8,16 (default: the physical cores).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Interleaved rounds (fresh processes each); medians reported.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Prompt tokens prefilled.")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens decoded.")
@json_option
def bench_llama_cpp(model_dir: Path, gguf: Path, llama_bench: Path, threads: tuple | None,
                    rounds: int, prompt_tokens: int, tokens: int, as_json: bool) -> None:
    """fermijit and llama.cpp on the same weights and cores: decode and prefill tok/s, fresh
    processes, interleaved rounds, medians and ratios."""
    from fermijit.bench import llama_cpp as bench_llama
    from fermijit.jit import cpu

    # fermijit's runs take this process's variants and thread binding.
    flags = ("--isa", cpu.selected_isa().label, "--decode-isa", cpu.decode_isa().label)
    flags += ("--pin-threads",) if cpu.threads_pinned() else ()
    bench_llama.run(model_dir, gguf, llama_bench, threads or (cpu.physical_cores(),), rounds,
                    prompt_tokens, tokens, as_json, flags)


@bench.command("serve")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="A fermijit model directory or GGUF file (default: the embedded model).")
@synthetic_option
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Random prompt tokens per stream.")
@click.option("--tokens", type=click.IntRange(min=2), default=32, show_default=True,
              help="Tokens generated per stream.")
@click.option("--chat-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Tokens of the chat's first message (what the cache saves on the second "
                   "turn).")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Second turns timed with and without the cache (medians).")
@click.option("--ttft-lengths", default="1024,4096,16384", show_default=True,
              help="Prompt lengths whose time to first token is measured alone (those the "
                   "model's context holds).")
@click.option("--long-prompt", type=click.IntRange(min=1), default=8192, show_default=True,
              help="The prompt that arrives while 4 streams decode.")
@threads_option
@numa_option
@prefill_options
@json_option
def bench_serve(model_dir: Path | None, synthetic: str | None, prompt_tokens: int, tokens: int,
                chat_tokens: int, repeat: int, ttft_lengths: str, long_prompt: int,
                threads: int | None, prefill: str, gpu_mem: str | None, pin_budget: str | None,
                verbose: bool, as_json: bool) -> None:
    """The server through HTTP: time to first token alone at 1k/4k/16k tokens and at 1, 2, 4
    and 8 concurrent streams with their aggregate decode tok/s, 4 streams' rate while a long
    prompt prefills, a chat's second turn with and without the prefix cache, peak RSS."""
    from fermijit import engine
    from fermijit.bench import serve as bench_serve_module
    from fermijit.jit import cpu

    cpu.configure_threads(threads)
    if model_dir is None and synthetic is None:
        model_dir = engine.DEFAULT_MODEL
    lengths = tuple(_int_list("--ttft-lengths", ttft_lengths))
    bench_serve_module.run(None if model_dir is None else _model_directory(model_dir),
                           synthetic if model_dir is None else None, prompt_tokens, tokens,
                           chat_tokens, repeat, as_json, prefill=prefill, gpu_mem=gpu_mem,
                           pin_budget=pin_budget, ttft_lengths=lengths, n_long=long_prompt)


@bench.command("gpu")
@json_option
@click.option("--tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Prefill length T the kernels are measured at.")
@click.option("--only", multiple=True, metavar="NAME",
              help="Only the layer ops whose name contains NAME (repeatable; no GEMMs).")
def bench_gpu(as_json: bool, tokens: int, only: tuple[str, ...]) -> None:
    """FMA ceiling and copy bandwidth of Fermi-ISA PTX, then each GPU kernel at prefill shapes."""
    from fermijit.bench import gpu as bench_gpu_module

    bench_gpu_module.run(as_json=as_json, n_tokens=tokens, only=only)


@bench.command("vision")
@click.option("--size", "sizes", multiple=True, default=None,
              help="Image size WIDTHxHEIGHT (repeatable; default 448x448 and 1024x768).")
@click.option("--depth", type=click.IntRange(min=1), default=None,
              help="Tower blocks (default: the real 27).")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs per image; the median is shown.")
@threads_option
@json_option
def bench_vision(sizes: tuple[str, ...], depth: int | None, repeat: int, threads: int | None,
                 as_json: bool) -> None:
    """Seconds per image through the full-size vision tower (random weights), CPU and GPU."""
    from fermijit.bench import vision as bv
    from fermijit.jit import cpu

    cpu.configure_threads(threads)
    parsed = []
    for size in sizes:
        try:
            width, height = (int(n) for n in size.lower().split("x"))
        except ValueError:
            raise click.BadParameter(f"--size takes WIDTHxHEIGHT, got {size!r}")
        if not (0 < width <= 16384 and 0 < height <= 16384):
            raise click.BadParameter(f"--size {size}: sides must be in [1, 16384]")
        parsed.append((width, height))
    bv.run(parsed, depth, repeat, as_json, None)


@bench.command("prune")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="A fermijit model directory (default: the embedded model).")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              required=True, help="UTF-8 calibration text.")
@click.option("--heldout", "heldout_path",
              type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="UTF-8 text to score, disjoint from --text.")
@click.option("--keep", "keeps", type=click.IntRange(min=1), multiple=True,
              help="Experts kept per layer (repeat for several counts).")
@click.option("--ratio", "ratios", type=float, multiple=True,
              help="Fraction of the experts pruned per layer, as well as or instead of --keep "
                   "(repeat for several).")
@click.option("--ctx", "context", type=click.IntRange(min=1), default=None,
              help="Tokens per calibration and scoring window (default: 512, at most "
                   "max_position_embeddings).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Calibrate on at most this many tokens, spread over the text (one "
                   "shorter window where fewer than --ctx).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the random pruning.")
@json_option
@threads_option
def bench_prune(model_dir: Path | None, text_path: Path, heldout_path: Path,
                keeps: tuple[int, ...], ratios: tuple[float, ...], context: int | None,
                max_tokens: int | None, seed: int, as_json: bool, threads: int | None) -> None:
    """Held-out perplexity and size of the model pruned by REAP, by routed-token frequency and
    at random to the same expert count, next to the full model's."""
    from fermijit import engine
    from fermijit.bench import prune as bench_prune_module
    from fermijit.jit import cpu

    cpu.configure_threads(threads)
    bench_prune_module.run(model_dir or engine.DEFAULT_MODEL, text_path, heldout_path, keeps,
                           ratios, context, max_tokens, seed, as_json)


@bench.command("quant")
@click.option("--hf", "hf_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              required=True, help="An HF checkpoint directory, converted into each mix.")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              required=True, help="UTF-8 held-out text to score (the default model's: "
                                  "build/default_corpus/heldout.txt, training/corpus.py).")
@click.option("--ctx", "context", type=click.IntRange(min=1), default=None,
              help="Tokens per scoring window (default: 512, at most max_position_embeddings).")
@click.option("--max-tokens", type=click.IntRange(min=2), default=None,
              help="Score at most the text's first this many tokens.")
@click.option("--decode-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Decode tokens a round.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Decode rounds, alternating the mixes (medians shown).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Numba threads (default: all cores).")
def bench_quant(hf_dir: Path, text_path: Path, context: int | None, max_tokens: int | None,
                decode_tokens: int, rounds: int, as_json: bool, threads: int | None) -> None:
    """The quantisation mixes of `convert --quant` (q4_0, q4_k_m) of one checkpoint: held-out
    perplexity (and fp32's), bytes a decode token reads, decode tok/s on this CPU."""
    from fermijit.bench import quant as bench_quant_module
    from fermijit.jit import cpu

    cpu.configure_threads(threads)
    bench_quant_module.run(hf_dir, text_path, context, max_tokens, decode_tokens, rounds,
                           as_json)


@bench.command("cache")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="A fermijit model directory (default: the embedded model).")
@click.option("--tokens", type=click.IntRange(min=2), default=947, show_default=True,
              help="Prompt tokens (random ids).")
@click.option("--snapshot-every", type=click.IntRange(min=1), default=None,
              help="Snapshot interval (default: the cache's, 256).")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="Repetitions (cases interleaved); the median is shown.")
@click.option("--sweep", is_flag=True, help="Also time cold+snap and branched per snapshot "
                                            "interval (64, 128, 256, 512).")
@threads_option
@json_option
def bench_cache(model_dir: Path | None, tokens: int, snapshot_every: int | None, repeat: int,
                sweep: bool, threads: int | None, as_json: bool) -> None:
    """Snapshot prefix cache: a prompt cold, repeated, extended by 32 tokens and branched at a
    random point; time, speed-up against cold, snapshot bytes and count."""
    from fermijit import engine
    from fermijit.bench import cache as bc
    from fermijit.cache import prefix_cache
    from fermijit.jit import cpu

    cpu.configure_threads(threads)
    bc.run(model_dir or engine.DEFAULT_MODEL, tokens,
           snapshot_every or prefix_cache.SNAPSHOT_EVERY, repeat, sweep, as_json)


@bench.command("prefill")
@full_size_options
@click.option("--tokens", type=click.IntRange(min=1), default=947, show_default=True,
              help="Prompt tokens (random ids).")
@click.option("--gpu-mem", default=None, help="GPU memory budget, e.g. 6G (default: free less "
                                              "512 MiB).")
@click.option("--pin-budget", default=None, help="Page-locked host memory for the experts.")
@json_option
@click.option("--verbose", is_flag=True, help="Per-layer copy/compute/overlap and the profile.")
@click.option("--project", "projection", type=click.Choice(["c2075"]), default=None,
              help="Project the run onto this GPU (the cost model is printed).")
@click.option("--sweep", default=None, help="Instead: CPU vs GPU prefill time at these prompt "
                                            "lengths, e.g. 8,32,128 (the auto threshold).")
@kv_option
def bench_prefill(model_dir: Path | None, synthetic: str | None, tokens: int,
                  gpu_mem: str | None, pin_budget: str | None, as_json: bool, verbose: bool,
                  projection: str | None, sweep: str | None, kv_cache: str) -> None:
    """GPU prefill time against the PCIe and compute floors measured in the same run; pinned vs
    pageable expert streaming (GPU)."""
    from fermijit.bench import prefill as bp

    if sweep is not None:
        bp.sweep(model_dir, synthetic, _int_list("--sweep", sweep), kv=_kv(kv_cache))
        return
    bp.run(model_dir, synthetic, tokens, gpu_mem, pin_budget, as_json, verbose, projection,
           kv=_kv(kv_cache))


@bench.command("longctx")
@full_size_options
@click.option("--lengths", default="1024,4096,16384,32768", show_default=True,
              help="Prompt lengths, comma-separated.")
@click.option("--decode-tokens", type=click.IntRange(min=1), default=24, show_default=True,
              help="Decode tokens a window (decode at each length and at 64 positions in "
                   "windows taken in turn).")
@click.option("--pairs", "n_pairs", type=click.IntRange(min=1), default=5, show_default=True,
              help="Windows at each length, each paired with one at 64 positions; the median "
                   "of the pairs' ratios is reported.")
@click.option("--gpu", "use_gpu", is_flag=True, help="Also time the GPU prefill of each length.")
@threads_option
@json_option
@kv_option
def bench_longctx(model_dir: Path | None, synthetic: str | None, lengths: str,
                  decode_tokens: int, n_pairs: int, use_gpu: bool, threads: int | None,
                  as_json: bool, kv_cache: str) -> None:
    """Long context: CPU (and GPU) prefill tok/s, decode tok/s against decode at 64 positions in
    paired windows of the same run, KV cache bytes and memory, per prompt length."""
    from fermijit.bench import longctx as bl

    bl.run(model_dir, synthetic, tuple(_int_list("--lengths", lengths)), decode_tokens, use_gpu,
           threads, as_json, kv=_kv(kv_cache), n_pairs=n_pairs)


@cli.group()
def kernels() -> None:
    """The GPU kernels (PTX templates in kernels_ptx/)."""


@kernels.command("check")
@click.option("--ptxas", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="ptxas to use (default: PATH, /usr/local/cuda, the nvidia wheel).")
@json_option
def kernels_check(ptxas: Path | None, as_json: bool) -> None:
    """Assemble every PTX variant for .target sm_20 with ptxas (no GPU needed); exit 1 on a
    kernel that breaks Fermi's limits."""
    from fermijit.jit import ptx_check as checker

    sys.exit(checker.run(ptxas, as_json))


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--quant", "mix", type=click.Choice(["q4_0", "q4_k_m"]), default="q4_0",
              show_default=True,
              help="Quantisation mix of an HF checkpoint: fermijit's Q4_0, or llama.cpp's "
                   "Q4_K_M (Q4_K, Q6_K for the output head and some V/down projections; "
                   "`bench quant` compares them on this CPU).")
@lm_head_option
def convert(src: Path, dst: Path, mix: str, lm_head: str | None) -> None:
    """Convert SRC, an HF checkpoint directory or a GGUF file (llama.cpp's qwen35moe), into a
    4-bit fermijit model directory DST."""
    # SRC is checked by the converter, not click.Path(exists=True): a usage error is 3 lines.
    from fermijit.model import convert as converter

    manifest = converter.convert(src, dst, lm_head=lm_head, mix=mix)
    click.echo(f"wrote {dst}: {converter.describe(manifest)}", err=True)


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(dir_okay=False, path_type=Path))
def export(src: Path, dst: Path) -> None:
    """Write the fermijit model SRC as a GGUF file DST (llama.cpp's qwen35moe, the same
    quantised bytes), for llama.cpp to run the same weights (`bench llama-cpp`)."""
    from fermijit.model import gguf_export

    written = gguf_export.export(src, dst, show_progress=sys.stderr.isatty())
    click.echo(f"wrote {dst}: {written['tensors']} tensors, {written['bytes'] / 1e9:.2f} GB in "
               f"{written['seconds']:.1f} s", err=True)


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              required=True, help="UTF-8 calibration text (keep it apart from any text you "
                                  "evaluate on).")
@click.option("--keep", type=click.IntRange(min=1), default=None,
              help="Experts kept per layer.")
@click.option("--ratio", type=float, default=None,
              help="Fraction of the experts pruned per layer, instead of --keep (0.5: half).")
@click.option("--criterion", type=click.Choice(["reap", "frequency", "random"]), default="reap",
              show_default=True, help="What ranks the experts: REAP saliency, the count of "
                                      "tokens routed, or a seeded random order (baselines).")
@click.option("--ctx", "context", type=click.IntRange(min=1), default=None,
              help="Tokens per calibration window, each run from a fresh state (default: 512, "
                   "at most max_position_embeddings).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Calibrate on at most this many tokens, in windows spread over the text "
                   "(one shorter window where fewer than --ctx; default: all of it).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of --criterion random.")
@click.option("--calibrate-with", type=click.Path(path_type=Path), default=None,
              help="Run calibration on this model instead of SRC (e.g. the 4-bit conversion "
                   "of an HF checkpoint too big to run in fp32); same layers and experts.")
@threads_option
@prefill_options
def prune(src: Path, dst: Path, text_path: Path, keep: int | None, ratio: float | None,
          criterion: str, context: int | None, max_tokens: int | None, seed: int,
          calibrate_with: Path | None, threads: int | None, prefill: str, gpu_mem: str | None,
          pin_budget: str | None, verbose: bool) -> None:
    """Prune the experts of SRC (a fermijit model or an HF checkpoint) by REAP into DST, of the
    same kind; calibration runs the engine over --text."""
    from fermijit.jit import cpu
    from fermijit.model import prune as pruner

    cpu.configure_threads(threads)
    pruner.run(src, dst, text_path, keep, ratio, context, max_tokens, criterion, seed,
               calibrate_with, prefill=prefill, gpu_mem=gpu_mem, pin_budget=pin_budget,
               verbose=verbose)


@cli.command()
@click.argument("name", type=SYNTHETIC_NAMES)
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Decoder layers (default: the real 40).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the random weights.")
@click.option("--quant", "mix", type=click.Choice(["q4_0", "q4_k_m"]), default="q4_0",
              show_default=True, help="The quantisation mix's kinds (as `convert --quant`).")
@lm_head_option
def synth(name: str, dst: Path, layers: int | None, seed: int, mix: str,
          lm_head: str | None) -> None:
    """Write a random-weight model of the real shapes of NAME into the new directory DST, in the
    converted format (qwen3.6-35b-a3b: 256 experts, 19.7 GB; -reap128: 128 experts, 11.2 GB)."""
    from fermijit.model import synth as synthetic

    click.echo(synthetic.synth(name, dst, layers=layers, seed=seed, mix=mix,
                                   lm_head=lm_head).summary(),
               err=True)


@cli.command()
@click.option("--model", "model_dir", type=click.Path(path_type=Path), required=True,
              help="A fermijit model directory (from `convert`).")
def verify(model_dir: Path) -> None:
    """Check every tensor of a fermijit model against the checksum `convert` recorded (a
    progress bar on stderr); exit 2 naming the first damaged tensor. Loading checks only the
    manifest and the smallest tensors."""
    from fermijit.model import manifest

    n_tensors, nbytes = manifest.verify(model_dir)
    click.echo(f"{model_dir}: {n_tensors} tensors, {nbytes / 2**20:.1f} MiB, all match their "
               f"checksums")


@cli.command()
@click.argument("prompt", required=False)
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="A fermijit model directory (from `convert`), a GGUF file (converted once into "
                   "the cache: $FERMIJIT_CACHE, else ~/.cache/fermijit), or an HF checkpoint "
                   "directory (run unquantised in fp32, for reference runs). Default: the "
                   "embedded model (fermijit/default_model, trained on the Python docs).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Most tokens to generate.")
@click.option("--temperature", type=click.FloatRange(min=0), default=None,
              help="0 is greedy (default: generation_config.json, else 1.0).")
@click.option("--top-k", type=click.IntRange(min=0), default=None,
              help="Keep the k most likely tokens, 0 all (default: generation_config.json, "
                   "else 50).")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Nucleus mass, 1 all (default: generation_config.json, else 1.0).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the sampler.")
@threads_option
@click.option("--ctx", "context", type=click.IntRange(min=1), default=None,
              help="Context length: the prompt and the tokens generated, at least one "
                   "(default: prompt + max tokens, at most max_position_embeddings).")
@numa_option
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message through the model's "
                                           "chat template.")
@cache_options
@click.option("--image", "images", type=click.Path(path_type=Path), multiple=True,
              help="An image file for the user turn, before the text (repeatable; implies "
                   "--chat; the model needs its vision tower).")
@max_image_tokens_option
@prefill_options
@kv_option
@click.option("--speculative", type=click.Choice(["none", "mtp"]), default="none",
              show_default=True,
              help="mtp: draft tokens with the model's MTP head and verify them in one step "
                   "(the same text at temperature 0, the same distribution sampling).")
@draft_option
def generate(prompt: str | None, model_dir: Path | None, max_tokens: int, temperature: float | None,
             top_k: int | None, top_p: float | None, seed: int, threads: int | None,
             context: int | None, chat: bool, no_cache: bool, cache_dir: Path | None,
             cache_mem: int | None, snapshot_every: int | None, cache_key: str | None,
             images: tuple[Path, ...], max_image_tokens: int, prefill: str,
             gpu_mem: str | None, pin_budget: str | None, verbose: bool, kv_cache: str,
             speculative: str, draft: int, draft_vocab: int | None) -> None:
    """Continue PROMPT (read from stdin when absent); the continuation streams to stdout, a summary
    of timings to stderr. The prompt resumes from the longest prefix of it snapshotted before
    (in this process, or in --cache-dir)."""
    from fermijit import engine
    from fermijit.jit import cpu

    cpu.configure_threads(threads)
    settings = engine.Settings(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, context=context, is_chat=chat,
                               prefill=prefill, gpu_mem=gpu_mem, pin_budget=pin_budget,
                               verbose=verbose, images=images,
                               max_image_tokens=max_image_tokens,
                               drafts=_drafts(speculative, draft, draft_vocab))
    cache = _cache_settings(no_cache, cache_dir, cache_mem, snapshot_every, cache_key)
    from fermijit.model import files

    text = (files.read_text(sys.stdin.buffer, "standard input") if prompt is None
            else files.check_text(prompt, "the prompt"))
    if "stdout" in CLOSED_STREAMS:  # as asked (`>&-`), but said: rc 0 and no text looked fine
        click.echo("warning: standard output is closed: the generated text goes nowhere",
                   err=True)
    if prompt is None and "stdin" in CLOSED_STREAMS:  # `<&-`: read as empty, a text from nothing
        click.echo("warning: standard input is closed: the prompt is empty", err=True)
    engine.run(_model_directory(model_dir or engine.DEFAULT_MODEL), text, settings,
               cache_settings=cache, kv=_kv(kv_cache))


@cli.command()
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="A fermijit model directory, a GGUF file (converted once into the cache) or "
                   "an HF checkpoint directory (fp32, unbatched). Default: the embedded model.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="TCP port.")
@click.option("--api-key", default=None, envvar="FERMIJIT_API_KEY",
              help="Require `Authorization: Bearer KEY` on /v1 (env FERMIJIT_API_KEY).")
@click.option("--allow-origin", "origins", multiple=True,
              help="A web page's origin (scheme://host[:port], or * for any) allowed to call the "
                   "API from a browser (CORS); repeatable. Default: none.")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Sequences decoded together in one step.")
@click.option("--queue-size", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests waiting to join the batch; past it 503.")
@threads_option
@numa_option
@cache_options
@max_image_tokens_option
@prefill_options
@kv_option
@click.option("--kv-mem", type=SIZE, default=None,
              help="Memory the running requests' KV caches and states may hold, e.g. 4G; a "
                   "request that cannot fit is a 400 (ever) or 503 (now). Default: half the "
                   "memory available once the model is loaded.")
@click.option("--speculative", type=click.Choice(["auto", "mtp", "none"]), default="auto",
              show_default=True,
              help="Draft with the model's MTP head while one request is decoding (auto: where "
                   "the model has one and its decode reads enough bytes for it to pay; none: "
                   "off).")
@draft_option
def serve(model_dir: Path | None, host: str, port: int, api_key: str | None,
          origins: tuple[str, ...], max_batch: int, queue_size: int, threads: int | None,
          no_cache: bool, cache_dir: Path | None, cache_mem: int | None,
          snapshot_every: int | None, cache_key: str | None, max_image_tokens: int,
          prefill: str, gpu_mem: str | None, pin_budget: str | None, verbose: bool,
          kv_cache: str, kv_mem: int | None, speculative: str, draft: int,
          draft_vocab: int | None) -> None:
    """An OpenAI-compatible HTTP server: POST /v1/chat/completions and /v1/completions (streamed
    as server-sent events or not), GET /v1/models[/ID] and /health. Concurrent requests decode
    together; a chat's next turn resumes from the snapshot prefix cache."""
    from fermijit import engine
    from fermijit.jit import cpu
    from fermijit.server import run

    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise FermijitError("serve needs the server extra: pip install 'fermijit[server]'") \
            from None
    cpu.configure_threads(threads)
    run.serve(_model_directory(model_dir or engine.DEFAULT_MODEL), host, port, api_key, max_batch,
              queue_size, _cache_settings(no_cache, cache_dir, cache_mem, snapshot_every,
                                          cache_key),
              prefill, gpu_mem, pin_budget, verbose, max_image_tokens, kv=_kv(kv_cache),
              kv_mem=kv_mem, speculative={"auto": None, "mtp": True, "none": False}[speculative],
              drafts=_drafts(speculative, draft, draft_vocab), origins=origins)


@cli.command("eval")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="A fermijit model directory (run W4A8), a GGUF file (converted once into the "
                   "cache, then W4A8) or an HF checkpoint directory (fp32). Default: the "
                   "embedded model.")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              required=True, help="UTF-8 text file to score.")
@click.option("--ctx", "context", type=click.IntRange(min=1), default=None,
              help="Tokens per window, each scored from a fresh state (default: 512, at most "
                   "max_position_embeddings).")
@json_option
@threads_option
@numa_option
@prefill_options
@kv_option
def eval_command(model_dir: Path | None, text_path: Path, context: int | None, as_json: bool,
                 threads: int | None, prefill: str, gpu_mem: str | None, pin_budget: str | None,
                 verbose: bool, kv_cache: str) -> None:
    """Perplexity of the model on a text file: token count, mean NLL, perplexity, tok/s
    (teacher forcing, the forward of `generate`); progress on stderr."""
    from fermijit import engine, evaluate
    from fermijit.jit import cpu

    cpu.configure_threads(threads)
    evaluate.run(_model_directory(model_dir or engine.DEFAULT_MODEL), text_path, context, as_json,
                 prefill=prefill, gpu_mem=gpu_mem, pin_budget=pin_budget, verbose=verbose,
                 kv=_kv(kv_cache))


def _model_directory(path) -> Path:
    """What --model names (gguf_convert.model_directory), gguf_convert imported only for a GGUF
    file: 0.1-0.16 s of every start of a converted model's server (issue 28 item 4)."""
    path = Path(path)
    if not path.is_file():
        return path
    from fermijit.model.gguf_convert import model_directory

    return model_directory(path)


# The standard streams that were closed when the process started (`>&-`), now /dev/null.
CLOSED_STREAMS: set[str] = set()


def _open_missing_streams() -> None:
    """A closed stderr (`2>&-`) is None in Python, and print(file=None) writes to stdout: the
    diagnostics landed in the generated text. Closed streams read and write
    /dev/null instead."""
    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, mode))
            CLOSED_STREAMS.add(name)


def _fail(message: str) -> None:
    # The first line only: a library message is one line, an OS or click one may not be.
    try:
        print(f"Error: {message.splitlines()[0] if message else 'failed'}", file=sys.stderr,
              flush=True)
    except OSError:
        pass
    try:
        sys.stdout.flush()
    except OSError:
        # stdout is unwritable (/dev/full, a closed pipe): point it at /dev/null, so the
        # interpreter's flush at exit neither fails nor prints a second error.
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    sys.exit(2)


# `serve` with the GPU prefill (any --prefill but cpu): the CUDA driver started on a thread from
# here, before the commands' imports (numba's ~0.4 s), by the driver API through ctypes (which
# releases the GIL): cuInit and the device's primary context, made once per process, are then
# found made when the GPU's preparation asks pycuda for them (issue 28 item 4: its "driver"
# part). The context is fermijit's anyway (jit/gpu.py driver() retains the primary one); no GPU
# or no driver: nothing happens. FERMIJIT_EARLY_DRIVER=0: not done. From the same thread the
# model file is mapped and registered with the driver (fermijit/jit/gpu_early.py: the 11 GB
# file's 1.1-1.25 s had begun only after the load, ~0.9 s after exec, on the H200's host), where
# the GPU's preparation will register it (`_early_registration`); FERMIJIT_EARLY_REGISTER=0: the
# driver only.
EARLY_DRIVER_ENV = "FERMIJIT_EARLY_DRIVER"
EARLY_REGISTER_ENV = "FERMIJIT_EARLY_REGISTER"


def _command(argv: list[str]) -> str | None:
    """The subcommand named in `argv` (without the program), before click parses it."""
    return next((w for i, w in enumerate(argv) if not w.startswith("-")
                 and (i == 0 or argv[i - 1] not in ("--isa", "--decode-isa"))), None)


def _start_driver_early(argv: list[str]) -> bool:
    """Whether `argv` (without the program) is a `serve` that may use the GPU: then the driver
    is started on a thread (and the model file registered from there)."""
    words = " ".join(argv)
    if (_command(argv) != "serve" or os.environ.get(EARLY_DRIVER_ENV, "1") == "0"
            or "--prefill cpu" in words or "--prefill=cpu" in words
            or "-h" in argv or "--help" in argv):
        return False
    from fermijit.jit import gpu_early

    gpu_early.start(None if os.environ.get(EARLY_REGISTER_ENV, "1") == "0"
                    else lambda: _early_registration(argv))
    return True


def _option(argv: list[str], name: str) -> str | None:
    """The value `argv` gives option `name` (`name V` or `name=V`; the last), or None."""
    value = None
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(name + "="):
            value = word[len(name) + 1:]
    return value


def _early_registration(argv: list[str]):
    """What serve's GPU preparation will register, decided as it decides, for
    gpu_early.start: (the weights file, the most bytes it may register, the NUMA policy's
    setter), or None. The file of `--model DIR` (a fermijit model: fermijit.json names it; the
    default model, a GGUF file, an HF checkpoint: None); registered in place where the
    experts' pool fits --pin-budget (hybrid.plan's "pinned", tried as "mapped": the pool's bytes
    are the file's experts, so a file within the budget is a pool within it); each
    registering thread placed by the weights' --numa policy first, as the loader's are."""
    from fermijit.host import numa
    from fermijit.model import files
    from fermijit.prefill import hybrid

    model = _option(argv, "--model")
    if model is None or not Path(model).is_dir():
        return None
    directory = Path(model)
    manifest = directory / "fermijit.json"
    if not manifest.is_file():
        return None
    weights = files.member(directory, files.read_json(manifest).get("weights"), str(manifest))
    budget = _option(argv, "--pin-budget")
    pin_budget = (hybrid.default_pin_budget() if budget is None
                  else hybrid.parse_bytes(budget))
    policy = _option(argv, "--numa") or numa.default_policy()
    if policy not in numa.CHOICES:
        return None  # click says why
    place = None if policy == "off" else (
        lambda address, nbytes: numa.apply_to([(address, nbytes)], policy))
    return weights, pin_budget, place


# `serve`: Python's cyclic garbage collector off from here until the model is loaded (issue 28
# item 4): the imports and the load make ~95,000 objects that live as long as the process and
# almost no garbage (54 objects collected), and the collector went through them again and again
# (~215 young, 19 middle and one full collection: 0.07-0.1 s of a full-size start on 2 cores).
# server/run.py then freezes what is there (never traversed again) and turns it back on, before
# the warm-up, whose compiles on a cold kernel cache do make garbage.
# FERMIJIT_START_GC=1: collected as always.
START_GC_ENV = "FERMIJIT_START_GC"


class _Diagnostics:
    """sys.stderr while a command runs: once a write or flush fails (stderr on a full disk, its
    pipe's reader gone: `serve 2>&1 | tee log` and tee killed), diagnostics are dropped, the
    work goes on. The OSError came out of whatever was printing: serve's "ready" line ended
    the server (its port closed, the process kept alive by its threads), a warning on the
    scheduler's thread would have ended that thread, and `generate 2>/dev/full` gave no text.
    Dropped from the first failure on: a stream whose flush failed keeps what it holds, and a
    server's rare lines would have grown it for ever. The exit status still says a failure."""

    def __init__(self, stream):
        self._stream, self._failed = stream, False

    def write(self, text: str) -> int:
        if not self._failed:
            try:
                return self._stream.write(text)
            except OSError:
                self._failed = True
        return len(text)

    def flush(self) -> None:
        if not self._failed:
            try:
                self._stream.flush()
            except OSError:
                self._failed = True

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main() -> None:
    import gc

    _open_missing_streams()
    stderr, sys.stderr = sys.stderr, _Diagnostics(sys.stderr)
    argv = sys.argv[1:]
    gc_off = _command(argv) == "serve" and os.environ.get(START_GC_ENV) != "1" and gc.isenabled()
    if gc_off:
        gc.disable()
    try:
        _main(argv)
    finally:
        sys.stderr = stderr  # as it was (run in-process: tests)
        if gc_off:  # a serve that stopped before its load (bad input), run in-process (tests)
            gc.enable()


def _main(argv: list[str]) -> None:
    _start_driver_early(argv)
    try:
        cli.main(standalone_mode=False)
        sys.stdout.flush()  # a write error of buffered output surfaces here, not at exit
    except click.exceptions.Abort as e:
        click.echo("Aborted.", err=True)
        # Ctrl-C (click's Abort from the KeyboardInterrupt): 128 + SIGINT, as a shell tells a
        # process SIGINT stopped (it was 1, a failure like any other to a script)
        sys.exit(130 if isinstance(e.__cause__ or e.__context__, KeyboardInterrupt) else 1)
    except click.ClickException as e:
        # One line for every command, usage errors included (bad input: one line, exit 2).
        _fail(e.format_message())
    except FermijitError as e:
        _fail(str(e))
    except OSError as e:
        # What the library does not name itself: stdout full (/dev/full) or closed, a disk
        # that fails under a read. One line, as any bad environment.
        if e.errno == errno.ENOMEM:  # an mmap refused (the state's reserve): memory, not a file
            _fail(_out_of_memory())
        where = f": {e.filename}" if e.filename else ""
        _fail(f"{e.strerror or e}{where}")
    except MemoryError:
        _fail(_out_of_memory())
    except ModuleNotFoundError as e:
        # A core dependency absent from this Python (fermijit run from a checkout by an
        # interpreter it was not installed into): one line, not the import's traceback.
        if (e.name or "").partition(".")[0] not in CORE_MODULES:
            raise
        _fail(missing_dependency(e.name))


def _out_of_memory() -> str:
    """The one line for memory refused, naming the address-space limit where one is set: under
    `ulimit -v` the model's few hundred MB of mappings fail long before RAM runs out ("Error:
    Cannot allocate memory" said neither)."""
    import resource

    message = "out of memory"
    for name, limit in (("ulimit -v", resource.RLIMIT_AS), ("ulimit -d", resource.RLIMIT_DATA)):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            message += f" (limited to {soft >> 20} MiB by {name})"
            break
    return message
