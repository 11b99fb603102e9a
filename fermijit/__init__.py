"""fermijit: Qwen3.6-35B-A3B in 4 bits on a Westmere CPU and a Fermi GPU, in pure Python.

This folder's own files are what a user meets: the CLI (cli.py, click), the generate loop and
`Engine` (engine.py), `eval` (evaluate.py), speculative decoding with the MTP head
(speculative.py), the warm-up and its compile helpers (warm.py), the `info` report (machine.py),
and here `FermijitError`. Below them, by concern (each folder's __init__ says what it owns and
what it may import):

    server/    `serve`: the OpenAI-compatible HTTP server
    bench/     `bench ...`: one module per benchmark
    prefill/   which device prefills a prompt; the GPU prefill
    cache/     the snapshot prefix cache, in memory and on disk
    jit/       CPU variant choice, SIMD intrinsics, Numba's cache; PTX rendering and loading
    host/      NUMA placement of the weights, numpy's BLAS threads

ops/, model/ and kernels_ptx/ stand at the repository's top and install as fermijit.ops,
fermijit.model and fermijit.kernels_ptx (README, Layout). These files may import everything;
below them only the server and the benchmarks import them (and model/'s `prune` driver,
model/prune.py and reap.py, reaches up to evaluate.py).
"""

__version__ = "0.1.0"


class FermijitError(Exception):
    """A user-facing failure: the message is one line, shown without a traceback."""


def env_number(name: str, default, kind=float, minimum=0, unit: str = ""):
    """The number environment variable `name` holds (`kind`: int or float), `default` where it
    is unset or empty; a word, NaN, infinity or less than `minimum` is a FermijitError naming the
    variable (and the `unit` of its number; the tuning variables' float() or int() had been
    tracebacks)."""
    import math
    import os

    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum:
        whole = ("a whole number" if kind is int else "a number") + (f" of {unit}" if unit else "")
        raise FermijitError(f"{name} must be {whole} >= {minimum}, got {text!r}")
    return value


def private_dir(path) -> bool:
    """`path` made (or found) as a directory of ours alone: cached kernels are code to run, so a
    folder another user could write to is not one to load them from."""
    import os
    import tempfile

    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            return False
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def private_cache_dir():
    """Our folder for what is cached across runs (a Path): $FERMIJIT_CACHE, else
    `user_cache_dir()`/fermijit (model/data_hash.py cache_root's), else fermijit-<uid> in the
    temp directory, the first `private_dir` takes; None where none."""
    import os
    import tempfile
    from pathlib import Path

    user = user_cache_dir()  # None: no home (no HOME, no passwd entry)
    given = os.environ.get("FERMIJIT_CACHE")
    for folder in ([Path(given)] if given else []) + ([] if user is None else [
            user / "fermijit"]) + [Path(tempfile.gettempdir()) / f"fermijit-{os.getuid()}"]:
        if private_dir(folder):
            return folder
    return None


# The core dependencies' import names (pyproject.toml's dependencies).
CORE_MODULES = {"numba", "llvmlite", "numpy", "safetensors", "click", "tokenizers", "jinja2",
                "tqdm", "gguf", "PIL"}


def missing_dependency(name: str) -> str:
    """The line for a core dependency this Python lacks (the CLI's, and __main__'s for click)."""
    import sys

    return (f"the package {name.partition('.')[0]!r} is not installed for {sys.executable}: "
            "install fermijit into it (pip install -e .) or run the Python it is installed in")


def user_cache_dir():
    """The user's cache folder (a Path): $XDG_CACHE_HOME where it is absolute (the XDG spec has
    a relative one ignored: it was a folder of whatever the working directory was), else
    ~/.cache; None where there is no home (HOME unset and no passwd entry for the uid: a
    container run as an arbitrary user), where Path.home() raised RuntimeError."""
    import os
    from pathlib import Path

    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg)
    try:
        return Path.home() / ".cache"
    except RuntimeError:
        return None


def _take_back_cpus() -> None:
    """In a child of a process whose kernel threads are bound to cores (`--pin-threads`): the
    child starts bound to the one core of the parent's calling thread; it takes back the CPUs the
    parent could run on (jit/cpu.py CPUS_ENV), before Numba counts them for its threads."""
    import os

    cpus = os.environ.get("FERMIJIT_CPUS")
    if cpus:
        try:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        except (OSError, ValueError):
            pass  # a narrower cgroup than the parent's: stay where this process was put


_take_back_cpus()
