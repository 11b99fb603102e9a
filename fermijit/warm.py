"""The warm-up: compile (or load from Numba's cache) every kernel a run will use before it starts,
on a sample of the model's layers; on a first run, with helper processes compiling beside it.

Numba compiles one kernel at a time in a process (its global compiler lock), and a first run of
the REAP-128 model spent ~28 s of its ~30 s to first token compiling. The warm-up's work
splits into jobs that need no results from one another: the prefill and the decode step of one
layer of each kind. When the first kernel turns out not to be cached, helper processes start
(one per spare core, up to one per job) and run the jobs in the reverse of the order the warm-up
meets them, compiling into the shared disk cache, while this process runs the warm-up as
always. A compile is locked per kernel and signature among processes (jit/dispatch.py), so no
kernel is compiled twice: whoever comes second loads it from the cache.

Helpers only fill the cache: this process's warm-up compiles whatever it does not find, so a
helper that fails, hangs past the lock's wait or is killed costs time, never a result. They are
told to stop (their stdin closes) when the warm-up ends, and stop by themselves when this process
dies (the same pipe).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from fermijit import env_number

WARM_UP_TOKENS = 2  # a prefill of two tokens and a decode step compile or load every kernel
# FERMIJIT_COMPILE_WORKERS=N: at most N helpers (0: none); default one per core beyond the first.
WORKERS_ENV = "FERMIJIT_COMPILE_WORKERS"


def warm_up(model, prompt: np.ndarray, n_prefill: int = WARM_UP_TOKENS, sampler=None) -> float:
    """Compile (or load from Numba's cache) every kernel of prefill, decode and `sampler` on a
    throwaway state, so that the timings measure the model, not the JIT; returns the seconds it
    took. `sampler` is a twin of the real one, as sampling draws from its generator (its compile
    was 1.4 s of a cold run's "prefill"). Some ops switch to another kernel past a size (e.g.
    ops/rope.py TABLE_MIN_ELEMENTS): `n_prefill` as long as the prefills to come compiles
    those too (`eval` does; on the default model a cold prefill of 512 tokens compiled 7 more
    kernels, 3.7 s, after the 2-token one)."""
    start = time.perf_counter()
    model = kernel_sample(model)
    n_prefill = max(1, min(n_prefill, model.max_context - 1))  # and room for the decode step
    with Helpers(model, n_prefill):
        tokens = np.resize(prompt, n_prefill)
        state = model.new_state(n_prefill + 1)
        logits = model.prefill(tokens, state)
        if sampler is not None:
            sampler.sample(logits)
        model.decode(int(tokens[-1]), state)
    return time.perf_counter() - start


def weight_formats(x, path: str = "") -> tuple:
    """What picks a layer's kernels, not its values: the type, dtype and rank of every array and
    the kind of every weight it holds (a K-quant mix gives some layers' down projections another
    block format, or a permuted input), as (path, ...) leaves."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return tuple(leaf for f in dataclasses.fields(x)
                     for leaf in weight_formats(getattr(x, f.name), f"{path}.{f.name}"))
    if isinstance(x, (tuple, list)):
        return tuple(leaf for i, y in enumerate(x) for leaf in weight_formats(y, f"{path}[{i}]"))
    if isinstance(x, np.ndarray):
        return ((path, x.dtype.str, x.ndim),)
    return ((path, type(x).__name__, x if isinstance(x, (str, int, bool)) else None),)


def first_of_each_kind(model) -> list[int]:
    """The first layer of each kind: GDN or attention, with each of its weights' formats (as the
    GPU's sample: prefill/gpu_prefill.py warm_layers). Layers of a kind differ in their weights'
    values only, so they run the same kernels."""
    first: dict = {}
    for i, (attention_layer, layer) in enumerate(zip(model.is_attention, model.layers)):
        first.setdefault((attention_layer, weight_formats(layer)), i)
    return sorted(first.values())


def kernel_sample(model):
    """`model` cut to its first layers up to one of each kind (`first_of_each_kind`): the same
    kernels at a tenth of the work (4 of 40 layers), since layers of a kind differ only in their
    weights. On the REAP-128 shape the whole-model warm-up read ~1.7 GB of weights and ran 40
    layers' prefill GEMMs for nothing but loading kernels. A shallow copy: weights are shared."""
    n = first_of_each_kind(model)[-1] + 1
    return model if n == len(model.layers) else with_layers(model, range(n))


# Rows of the LM head kept by `light_sample`: the head's product takes the same kernel for any
# number of rows (ops/matvec.py picks by tokens), at 1/240 of the reap128 head's 0.5 GB.
LIGHT_HEAD_ROWS = 1024


def light_sample(model):
    """`model` cut to one layer of each kind and its LM head to its first LIGHT_HEAD_ROWS rows
    (vocab_size with it): the same kernels as the model's for any prompt or batch, for the
    server's extra warm-ups (fermijit/server/run.py: a prefill past the sizes where ops switch
    kernels, batched steps of 3+ rows), whose every step read the whole head and four layers'
    experts for nothing but loading kernels (+1.3 s of a full-size start on 2 cores)."""
    light = with_layers(model, first_of_each_kind(model))
    rows = min(LIGHT_HEAD_ROWS, model.vocab_size)
    w = model.lm_head
    if isinstance(w, np.ndarray):
        light.lm_head = w[:rows]
    else:  # matvec.Q4Matrix, QuantTensor, BlockTensor: every array's rows
        light.lm_head = dataclasses.replace(w, **{
            f.name: getattr(w, f.name)[:rows] for f in dataclasses.fields(w)
            if isinstance(getattr(w, f.name), np.ndarray) and getattr(w, f.name).ndim >= 1
            and getattr(w, f.name).shape[0] == model.vocab_size})
    light.vocab_size = rows
    return light


def with_layers(model, indices):
    """`model` cut to its layers `indices` (a shallow copy: the weights are shared)."""
    sample = copy.copy(model)
    sample.layers = tuple(model.layers[i] for i in indices)
    sample.is_attention = tuple(model.is_attention[i] for i in indices)
    sample._decode_ws = None  # its own (the original's is made on its first decode)
    return sample


# --- jobs: what a helper runs ---------------------------------------------------------------------

def jobs(model) -> list[str]:
    """The warm-up's independent parts, in the order the warm-up meets them: the prefill of each
    layer kind (one layer of it alone), then the decode step of each."""
    kinds = sorted(set(model.is_attention), key=model.is_attention.index)
    names = ["attention" if kind else "linear" for kind in kinds]
    return [f"prefill {n}" for n in names] + [f"decode {n}" for n in names]


def run_job(model, job: str, n_prefill: int) -> None:
    """One of `jobs(model)` on a throwaway state of a model of that one layer."""
    step, kind = job.split()
    layer = model.is_attention.index(kind == "attention")
    one = with_layers(model, [layer])
    n_prefill = max(1, min(n_prefill, model.max_context - 1))
    state = one.new_state(n_prefill + 1)
    if step == "prefill":
        one.prefill(np.zeros(n_prefill, np.int32), state)
    else:
        one.decode(0, state)


class Helpers:
    """Within `with`: on the first kernel compiled for want of a cached one, start the helper
    processes (none when the model was not loaded from a directory of ours, `model.source`);
    on exit, stop them and wait for them."""

    def __init__(self, model, n_prefill: int):
        self.model, self.n_prefill = model, n_prefill
        self.processes: list[subprocess.Popen] = []
        self.claims: str | None = None
        self.started = False
        self.n_workers = count_workers()  # here: a bad setting is said, not swallowed by _on_miss

    def __enter__(self):
        from fermijit.jit import dispatch

        self._previous, dispatch.on_miss = dispatch.on_miss, self._on_miss
        return self

    def __exit__(self, *exc):
        from fermijit.jit import dispatch

        dispatch.on_miss = self._previous
        self.stop()
        return False

    def _on_miss(self) -> None:
        if self.started:
            return
        self.started = True
        try:
            self.start()
        except Exception:  # noqa: BLE001  (helpers are an optimisation: never a failure)
            self.stop()

    def start(self) -> None:
        import numba

        import fermijit
        from fermijit.jit import cpu

        source = self.model.source
        job_list = jobs(self.model)
        n = min(self.n_workers, len(job_list))
        if source is None or n == 0:
            return
        self.claims = tempfile.mkdtemp(prefix="fermijit-warm-")
        env = cpu.child_env()
        args = [sys.executable, "-c", "from fermijit.warm import helper_main; helper_main()",
                str(Path(fermijit.__file__).resolve()), str(source), self.claims,
                str(self.n_prefill), cpu.selected_isa().label, cpu.decode_isa().label,
                str(numba.get_num_threads()),
                *reversed(job_list)]  # the jobs this process meets last, first
        for _ in range(n):
            self.processes.append(subprocess.Popen(
                args, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, close_fds=True))

    def stop(self) -> None:
        for p in self.processes:
            try:
                p.stdin.close()  # the helper's watcher sees EOF and exits at once
            except OSError:
                pass
        for p in self.processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.processes = []
        if self.claims is not None:
            shutil.rmtree(self.claims, ignore_errors=True)
            self.claims = None


def count_workers() -> int:
    """Helpers to start: FERMIJIT_COMPILE_WORKERS, else one per core beyond this process's."""
    return env_number(WORKERS_ENV, max(0, len(os.sched_getaffinity(0)) - 1), int)


def helper_main() -> None:
    """A helper process: argv = package file, model directory, claims folder, n_prefill, ISA
    label, decode's ISA label, threads, jobs. Claims each job no other helper has (a file made
    with O_EXCL in the claims folder) and runs it; exits when its stdin closes (the warm-up is
    over, or the process that started it died)."""
    package, source, claims, n_prefill, isa, decode_isa, threads, *job_list = sys.argv[1:]

    def watch_stdin():
        while os.read(0, 4096):  # the raw descriptor: a daemon thread blocked in sys.stdin's
            pass                 # buffered reader aborts the interpreter's shutdown
        os._exit(0)

    threading.Thread(target=watch_stdin, daemon=True).start()
    import fermijit

    if str(Path(fermijit.__file__).resolve()) != package:  # another install: other cache keys
        os._exit(0)
    from fermijit.jit import cpu

    cpu.select_isa(isa, decode_isa)  # before the ops are imported: ssse3 fixes Numba's target (pitfall 2)
    cpu.configure_threads(int(threads))
    from fermijit.model.forward import load_model

    _, model = load_model(source)
    model = kernel_sample(model)
    for job in job_list:
        try:
            os.close(os.open(os.path.join(claims, job), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        except OSError:  # the claims folder is gone: the warm-up is over
            os._exit(0)
        run_job(model, job, int(n_prefill))
    os._exit(0)  # done: no interpreter teardown (OpenMP's threads, LLVM) to wait for
