"""`python -m fermijit ...`: one click group, one subcommand per verb. Commands validate, call one
engine function and print; heavy imports (numba, pycuda, the model) happen inside commands so that
`--help` is instant. Library code raises FermijitError; `main` turns it into a one-line error."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from fermijit import FermijitError

ISA_CHOICES = ("ssse3", "avx2", "avx512vnni")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--isa", type=click.Choice(ISA_CHOICES), envvar="FERMIJIT_ISA", default=None,
              help="CPU kernel variant (default: the best this CPU has; env FERMIJIT_ISA). "
                   "ssse3 also compiles for a Westmere target.")
def cli(isa: str | None) -> None:
    """fermijit: Qwen3.6-35B-A3B in 4 bits on a Westmere CPU and a Fermi GPU."""
    from fermijit.jit import cpu

    cpu.select_isa(isa)


@cli.command()
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Numba threads (default: all cores).")
def info(threads: int | None) -> None:
    """CPU, SIMD features, kernel variants, threading, GPU and ptxas availability."""
    from fermijit import machine

    for key, value in machine.describe(threads):
        click.echo(f"{key + ':':<22} {value}")


@cli.group()
def bench() -> None:
    """Benchmarks: print a table, and JSON with --json."""


@bench.command("kernels")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Numba threads for the all-threads columns (default: all cores).")
@click.option("--gib", type=click.FloatRange(min=0.0625), default=1.0, show_default=True,
              help="Size of each cold weight set and of the bandwidth probe, in GiB.")
def bench_kernels(as_json: bool, threads: int | None, gib: float) -> None:
    """Read bandwidth, each GEMV variant's weight GB/s on cold weights, CPU-prefill GEMM GFLOP/s."""
    from fermijit import bench_cpu

    bench_cpu.run(as_json=as_json, n_threads=threads, gib=gib)


@bench.command("decode")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="A fermijit model directory.")
@click.option("--synthetic", type=click.Choice(["qwen3.6-35b-a3b", "qwen3.6-35b-a3b-reap128"]),
              default=None, help="Build this synthetic model into a temporary directory first "
                                 "(when no --model is given).")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Random prompt tokens to prefill.")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Greedy tokens to decode.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Numba threads (default: the physical cores).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--profile", is_flag=True, help="Also time one more token op by op (Python and "
                                              "dispatch apart from kernel time).")
def bench_decode(model_dir: Path | None, synthetic: str | None, prompt_tokens: int, tokens: int,
                 threads: int | None, as_json: bool, profile: bool) -> None:
    """Prefill a prompt, decode N tokens: tok/s, weight bytes per token, read bandwidth and the
    ceiling it implies, prefill against the W4A8 GEMM, peak RSS, load-to-first-token time."""
    from fermijit import bench_decode as bench_decode_module

    if model_dir is not None:
        synthetic = None
    bench_decode_module.run(model_dir, synthetic, prompt_tokens, tokens, threads, as_json, profile)


@bench.command("gpu")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Prefill length T the kernels are measured at.")
def bench_gpu(as_json: bool, tokens: int) -> None:
    """FMA ceiling and copy bandwidth of Fermi-ISA PTX, then each GPU kernel at prefill shapes."""
    from fermijit import bench_gpu as bench_gpu_module

    bench_gpu_module.run(as_json=as_json, n_tokens=tokens)


@cli.group()
def kernels() -> None:
    """The GPU kernels (PTX templates in kernels_ptx/)."""


@kernels.command("check")
@click.option("--ptxas", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="ptxas to use (default: PATH, /usr/local/cuda, the nvidia wheel).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
def kernels_check(ptxas: Path | None, as_json: bool) -> None:
    """Assemble every PTX variant for .target sm_20 with ptxas (no GPU needed); exit 1 on a
    kernel that breaks Fermi's limits."""
    from fermijit import kernels_check as checker

    sys.exit(checker.run(ptxas, as_json))


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--lm-head", type=click.Choice(["q8_0", "q4_0"]), default="q8_0", show_default=True,
              help="Quantisation of the output head, the matrix most sensitive to error.")
def convert(src: Path, dst: Path, lm_head: str) -> None:
    """Convert the HF checkpoint directory SRC into a 4-bit fermijit model directory DST."""
    # SRC is checked by the converter, not click.Path(exists=True): a usage error is 3 lines.
    from fermijit.model import convert as converter

    manifest = converter.convert(src, dst, lm_head=lm_head)
    click.echo(f"wrote {dst}: {converter.describe(manifest)}", err=True)


@cli.command()
@click.argument("name", type=click.Choice(["qwen3.6-35b-a3b", "qwen3.6-35b-a3b-reap128"]))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Decoder layers (default: the real 40).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the random weights.")
def synth(name: str, dst: Path, layers: int | None, seed: int) -> None:
    """Write a random-weight model of the real shapes of NAME into the new directory DST, in the
    converted format (qwen3.6-35b-a3b: 256 experts, 19.7 GB; -reap128: 128 experts, 11.2 GB)."""
    from fermijit.model import synth as synthetic

    click.echo(synthetic.synth(name, dst, layers=layers, seed=seed).summary(), err=True)


@cli.command()
@click.argument("prompt", required=False)
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="A fermijit model directory (from `convert`), or an HF checkpoint directory "
                   "(run unquantised in fp32, for reference runs). Default: the embedded model "
                   "(fermijit/default_model, trained on the Python docs).")
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
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Numba threads (default: all cores).")
@click.option("--ctx", "context", type=click.IntRange(min=1), default=None,
              help="Context length (default: prompt + max tokens, at most "
                   "max_position_embeddings).")
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message through the model's "
                                           "chat template.")
def generate(prompt: str | None, model_dir: Path | None, max_tokens: int, temperature: float | None,
             top_k: int | None, top_p: float | None, seed: int, threads: int | None,
             context: int | None, chat: bool) -> None:
    """Continue PROMPT (read from stdin when absent); the continuation streams to stdout, a summary
    of timings to stderr."""
    from fermijit import engine
    from fermijit.jit import cpu

    cpu.configure_threads(threads)
    settings = engine.Settings(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, context=context, is_chat=chat)
    engine.run(model_dir or engine.DEFAULT_MODEL, sys.stdin.read() if prompt is None else prompt,
               settings)


@cli.command("eval")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), default=None,
              help="A fermijit model directory (run W4A8) or an HF checkpoint directory (fp32). "
                   "Default: the embedded model.")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              required=True, help="UTF-8 text file to score.")
@click.option("--ctx", "context", type=click.IntRange(min=1), default=None,
              help="Tokens per window, each scored from a fresh state (default: 512, at most "
                   "max_position_embeddings).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Numba threads (default: all cores).")
def eval_command(model_dir: Path | None, text_path: Path, context: int | None, as_json: bool,
                 threads: int | None) -> None:
    """Perplexity of the model on a text file: token count, mean NLL, perplexity, tok/s
    (teacher forcing, the forward of `generate`); progress on stderr."""
    from fermijit import engine, evaluate
    from fermijit.jit import cpu

    cpu.configure_threads(threads)
    evaluate.run(model_dir or engine.DEFAULT_MODEL, text_path, context, as_json)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(1)
    except click.ClickException as e:
        # One line for every command, usage errors included (bad input: one line, exit 2).
        click.echo(f"Error: {e.format_message()}", err=True)
        sys.exit(2)
    except FermijitError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
