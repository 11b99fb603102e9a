"""CPU feature detection, the choice of SIMD variant, and Numba kernels cached by source.

The variant is chosen once, in Python, before anything compiles: compiling an AVX2 intrinsic for a
Westmere target aborts the whole process (notes/cpu-kernels.md, pitfall 5), and Numba's code
generation target is fixed by its first compile (pitfall 2). `select_isa` is that one place.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import re
import sys
from pathlib import Path

from fermijit import FermijitError, env_number, private_cache_dir

# Checked before Numba reads it on import: 0 or less raised ValueError there (a traceback), and
# a word was a warning with a traceback's text and then Numba's default.
env_number("NUMBA_NUM_THREADS", None, int, minimum=1, unit="threads")

import llvmlite.binding as llvm  # noqa: E402
import numba  # noqa: E402
from numba.core import config as numba_config  # noqa: E402
from numba.core import registry  # noqa: E402

from fermijit.jit.dispatch import Dispatcher, SourceKeyedCache


class Isa(enum.Enum):
    """A kernel variant, named by what it requires; `features` are LLVM's names."""

    SSSE3 = ("ssse3", ("ssse3",))
    AVX2 = ("avx2", ("avx2", "fma", "f16c"))
    AVX512VNNI = ("avx512vnni", ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "f16c"))

    def __init__(self, label: str, features: tuple[str, ...]):
        self.label = label
        self.features = features


# Best first: the default is the first variant whose features the CPU has all of.
PREFERENCE = (Isa.AVX512VNNI, Isa.AVX2, Isa.SSSE3)
WESTMERE = "westmere"
# What LLVM's `westmere` CPU implies when NUMBA_CPU_FEATURES is empty (no AVX, no F16C).
WESTMERE_FEATURES = frozenset({"sse", "sse2", "sse3", "ssse3", "sse4.1", "sse4.2", "popcnt",
                               "cx16", "sahf", "fxsr", "mmx", "pclmul"})

# Listed by `info`; the rest of the host's feature flags are noise for this project.
SHOWN_FEATURES = ("sse2", "ssse3", "sse4.1", "sse4.2", "popcnt", "avx", "f16c", "fma", "avx2",
                  "avx512f", "avx512bw", "avx512vl", "avx512vnni")

# The variant of one-token products (decode's GEMVs, which stream every weight once a token) where
# it is not the process's own. On AVX-512 machines, 256-bit code: Zen 4 runs a 512-bit operation
# as two 256-bit halves, and the zmm tile's extra block-sum permutes cost more than the wider
# loads save. REAP-128 model, 1 thread, same run (this Zen 4): 88 ms a token with the AVX2 GEMV,
# 93 with VNNI on ymm, 112 with the zmm tile; 2 threads 70 vs 76. Prefill (compute-bound GEMMs)
# keeps AVX-512: 1.5x AVX2's rate there. Not measured on Intel's AVX-512 cores.
DECODE_VARIANT = {Isa.AVX512VNNI: Isa.AVX2}

_selected: Isa | None = None
_decode: Isa | None = None

# How long libgomp's idle threads spin before they sleep (GOMP_SPINCOUNT: pause loops; libgomp's
# default 300000 is milliseconds). Between a token's launches they wait microseconds, so a short
# spin still catches the next fork; but a thread that spins through milliseconds holds a core
# that another process wanted, and the scheduler then charges it when it has work. This machine
# (2 cores shared with other processes' benchmarks, 8 full-size layers at 2 threads, paired
# windows of `bench decode`, fresh process each, interleaved): the default 19-98 % of the
# ceiling (collapsing whenever a neighbour runs), 100000 39 %, 30000 64-97, 10000 63-100, 3000
# 98-99, 1000 90-94, 0 (OMP_WAIT_POLICY=passive) 88-102 but ~8 % slower when the cores are free.
# Full size, `bench decode --threads 2` (512-token prompt, 64 tokens), a neighbour on one core
# (load 3-4), 3 rounds: the default 9.1-9.6 % (0.7 tok/s), 3000 73-76 % (5.6-6.0 tok/s); the
# cores free: 75-76 % and 74 % alike. A pause is ~10 ns here: 3000 spins ~30 us.
# Read by libgomp when it loads (Numba's first thread launch): set at import, unless the user
# chose a spin or a wait policy.
SPIN_ENV = "GOMP_SPINCOUNT"
DEFAULT_SPIN = "3000"


def _bounded_spin() -> None:
    """libgomp ignores a wait policy or spin count it cannot parse (two lines of its own on
    stderr, then the run goes on); and any OMP_WAIT_POLICY kept DEFAULT_SPIN out: a garbage one
    ran libgomp's default spin, the slowdown measured above. Both checked here, as libgomp
    parses them, before it reads them."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    if policy is not None and policy.strip().lower() not in ("active", "passive"):
        raise FermijitError(f"OMP_WAIT_POLICY must be active or passive, got {policy!r}")
    spin = os.environ.get(SPIN_ENV)
    if spin is not None and not re.fullmatch(r"\s*(\d+\s*[kmgt]?|infinite|infinity)\s*", spin,
                                             re.IGNORECASE):
        raise FermijitError(f"{SPIN_ENV} must be a whole number of spins (k, M, G or T "
                            f"suffixed) or infinite, got {spin!r}")
    if policy is None:
        os.environ.setdefault(SPIN_ENV, DEFAULT_SPIN)


_bounded_spin()


@functools.cache
def host_features() -> frozenset[str]:
    """The LLVM feature names this CPU has (numba's own view of the host). Asked once: LLVM's
    answer took ~120 us, and decode asked it per launch where a kernel is picked by ISA (the
    default model's MoE, its shared expert apart: ~8 ms of a 9 ms token)."""
    return frozenset(name for name, on in llvm.get_host_cpu_features().items() if on)


def target_features() -> frozenset[str]:
    """The features Numba will generate code for: the host's, unless forced (NUMBA_CPU_*)."""
    if numba_config.CPU_FEATURES is None:
        return host_features()
    forced = frozenset(f[1:] for f in numba_config.CPU_FEATURES.split(",") if f.startswith("+"))
    return forced | (WESTMERE_FEATURES if target_cpu_name() == WESTMERE else frozenset())


# Numba targets where a CPU name with NUMBA_CPU_FEATURES set adds nothing this CPU lacks: the
# Westmere target (`--isa ssse3`) and the baselines.
BASELINE_CPUS = frozenset({WESTMERE, "generic", "x86-64"})


def _check_forced_features() -> None:
    """NUMBA_CPU_FEATURES may take features away (the Westmere target) but not add ones this CPU
    lacks: LLVM then uses them where it vectorises, and the process died of SIGILL at the first
    such kernel, without a word (`+xop` on this Zen 5: a rotate became XOP's vprotd). Nor may
    NUMBA_CPU_NAME name another CPU while it is set: that CPU's own features come too
    (`NUMBA_CPU_NAME=bdver4 NUMBA_CPU_FEATURES=+ssse3`: XOP again). Unset, Numba passes this
    CPU's whole feature list, and a CPU name changes only the scheduling."""
    if numba_config.CPU_FEATURES is None:
        return
    name = numba_config.CPU_NAME
    if name and name not in BASELINE_CPUS | {llvm.get_host_cpu_name()}:
        raise FermijitError(f"NUMBA_CPU_NAME {name} with NUMBA_CPU_FEATURES set: code gets "
                            f"{name}'s own features too, which this CPU may lack (an illegal "
                            f"instruction); unset NUMBA_CPU_FEATURES to keep this CPU's")
    known = llvm.get_host_cpu_features()
    lacking = sorted(f[1:] for f in numba_config.CPU_FEATURES.split(",")
                     if f.startswith("+") and known.get(f[1:]) is False)
    if lacking:
        raise FermijitError(f"NUMBA_CPU_FEATURES asks for {', '.join(lacking)}, which this CPU "
                            f"lacks: code using it would die of an illegal instruction")


def target_cpu_name() -> str:
    return numba_config.CPU_NAME or llvm.get_host_cpu_name()


def supported(isa: Isa) -> bool:
    """True when code for `isa` can both be compiled for Numba's target and run on this CPU."""
    have = host_features() & target_features()
    return all(f in have for f in isa.features)


def _has_compiled() -> bool:
    return "_toplevel_target_context" in registry.cpu_target.__dict__


def _by_label(label: str) -> Isa:
    by_label = {i.label: i for i in Isa}
    if label not in by_label:
        raise FermijitError(f"unknown ISA {label!r}; choose one of {', '.join(by_label)}")
    return by_label[label]


def _require(isa: Isa) -> Isa:
    if not supported(isa):
        raise FermijitError(
            f"this CPU (or the Numba target {target_cpu_name()}) lacks {isa.label}: needs "
            f"{', '.join(isa.features)}")
    return isa


def select_isa(label: str | None = None, decode: str | None = None) -> Isa:
    """Fix the process's kernel variant. `label` None picks the best the CPU has; `decode` the
    variant of one-token products (None: DECODE_VARIANT's for the process's, where supported).

    `ssse3` also switches Numba to a Westmere target with no extra features, so the decode path
    is the one a Westmere Xeon runs (both variables are needed: pitfall 2).
    """
    global _selected, _decode
    _check_forced_features()
    if label is None:  # none at all (NUMBA_CPU_FEATURES without ssse3): the baseline's error
        isa = next((i for i in PREFERENCE if supported(i)), None) or _require(Isa.SSSE3)
    else:
        isa = _by_label(label)
        # Forced on a Westmere host too: the target's features are then "" rather than the
        # host's list, so kernels cached by a native `--isa ssse3` process are found by one under
        # `qemu -cpu Westmere` (the cache key holds the feature string; each miss compiled under
        # emulation, minutes a kernel).
        forced = numba_config.CPU_NAME == WESTMERE and numba_config.CPU_FEATURES == ""
        if isa is Isa.SSSE3 and not forced:
            if _has_compiled():
                if target_cpu_name() != WESTMERE:
                    raise FermijitError("--isa ssse3 must be chosen before any kernel is compiled")
            else:
                numba_config.CPU_NAME = WESTMERE
                numba_config.CPU_FEATURES = ""
        _require(isa)
    if decode is None:
        narrow = DECODE_VARIANT.get(isa, isa)
        dec = narrow if supported(narrow) else isa
    else:
        dec = _require(_by_label(decode))
    _selected, _decode = isa, dec
    return isa


def selected_isa() -> Isa:
    """The process's variant; the best available unless `select_isa` said otherwise."""
    return _selected or select_isa()


def decode_isa() -> Isa:
    """The variant of one-token products (decode): see DECODE_VARIANT and `select_isa`."""
    if _selected is None:
        select_isa()
    return _decode


def variants_up_to(isa: Isa) -> list[Isa]:
    """`isa` and every narrower variant, best first (what a kernel may fall back to)."""
    return list(PREFERENCE[PREFERENCE.index(isa):])


def physical_cores() -> int:
    """The cores this process may run on, SMT siblings counted once (each CPU's
    topology/thread_siblings_list); every allowed CPU where the topology cannot be read."""
    allowed = os.sched_getaffinity(0)
    cores = set()
    for n in allowed:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{n}/topology/thread_siblings_list")
                      .read_text().strip())
        except OSError:
            return len(allowed)
    return len(cores)


def child_env() -> dict[str, str]:
    """The environment for a child Python process that must run this fermijit with this kernel
    cache: this process's import path (a script's folder is not the child's sys.path[0]; another
    install has other cache keys) and kernel cache folder (maybe chosen here, as a fallback)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if numba_config.CACHE_DIR:
        env["NUMBA_CACHE_DIR"] = str(numba_config.CACHE_DIR)
    return env


_threads_chosen = False
# libgomp's settings that bind thread t of a team to physical core t (read when it loads).
PIN_ENV = {"OMP_PLACES": "cores", "OMP_PROC_BIND": "close"}
# The CPUs a pinning process could run on before its threads were bound: a child process (the
# read probe, the warm-up's helpers) starts bound where the parent's calling thread is, one core,
# and takes these back when fermijit is imported (fermijit/__init__.py), before Numba counts them.
CPUS_ENV = "FERMIJIT_CPUS"


def _threads_started() -> bool:
    from numba.np.ufunc import parallel as numba_parallel

    return bool(getattr(numba_parallel, "_is_initialized", False))


def pin_threads() -> None:
    """Bind thread t of every team to physical core t (`--pin-threads`: libgomp's places, so the
    caller, thread 0 of every launch, is bound to the first core). Unbound by default: on a busy
    machine a bound thread cannot move off a loaded core. Before any thread starts."""
    if _threads_started() and not threads_pinned():
        raise FermijitError("--pin-threads must be chosen before any kernel runs")
    os.environ.update(PIN_ENV)
    os.environ.setdefault(CPUS_ENV, ",".join(map(str, sorted(os.sched_getaffinity(0)))))


def threads_pinned() -> bool:
    return os.environ.get("OMP_PROC_BIND", "false").lower() not in ("false", "")


def configure_threads(n_threads: int | None) -> int:
    """Set Numba's thread count: `n_threads`, or by default the physical cores (an SMT sibling
    shares its core's load ports and caches: decode is bound by memory, prefill by those units).
    A later None keeps what was chosen. Prefers the omp layer (4x lower call overhead than
    workqueue: notes, section 5)."""
    global _threads_chosen
    numba_config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
    if n_threads is not None:
        if not 1 <= n_threads <= numba_config.NUMBA_NUM_THREADS:
            # Numba's pool is its ceiling: NUMBA_NUM_THREADS, else the CPUs this process may
            # run on (under `taskset -c 0` "between 1 and 1" said neither)
            why = ("NUMBA_NUM_THREADS" if os.environ.get("NUMBA_NUM_THREADS", "").strip()
                   else "the CPUs this process may run on: taskset, cpuset or cgroup")
            raise FermijitError(
                f"--threads must be between 1 and {numba_config.NUMBA_NUM_THREADS} ({why})")
        _set_num_threads(n_threads)
        _threads_chosen = True
    elif not _threads_chosen:
        _set_num_threads(max(1, min(physical_cores(), numba_config.NUMBA_NUM_THREADS)))
        _threads_chosen = True
    return numba.get_num_threads()


def _set_num_threads(n_threads: int) -> None:
    """numba.set_num_threads, which starts Numba's threads the first time: a threading layer it
    cannot load (NUMBA_THREADING_LAYER unknown, or tbb not installed) is a ValueError there."""
    try:
        numba.set_num_threads(n_threads)
    except ValueError as e:
        raise FermijitError(f"Numba's threads: {e}") from None


def on_a_passing_thread(work):
    """work() on a thread of its own that ends before this returns (its result, or its exception
    raised here), with this thread's Numba thread count. libgomp keeps a pool of workers for
    every thread that ever started a parallel region, for that thread's life, and while more
    workers live than there are CPUs every idle worker spins ~100 pauses, not GOMP_SPINCOUNT, before
    it sleeps: the server's decode on its scheduler thread, after the warm-up's regions on the
    main thread, took 3.4 ms a token of the embedded model against 0.45 (2 cores). Work before
    a long-lived thread's own goes here, so that that one's pool is the only one."""
    import threading

    n_threads = configure_threads(None)
    outcome: dict = {}

    def run() -> None:
        numba.set_num_threads(n_threads)
        try:
            outcome["value"] = work()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name="fermijit-passing")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


# --- kernels cached by source -------------------------------------------------------------------

_JIT_DIR = Path(__file__).resolve().parent
# Reassociation lets LLVM vectorise reductions; no `nnan`/`ninf`/`afn`, so NaN poisoning still
# shows and exp/log keep full accuracy. Under fast-math a function optimised alone and its copy
# optimised again inside a caller may round differently: a kernel runs only its own copies
# (jit/dispatch.py), so a first run, which compiles, gives later runs' bits (attention's differed
# by up to ~7e-7 until then). `contract` stays off: with it the GDN recurrence's first run was
# 3e-11 off later runs' (generated text diverged after ~70 tokens), measured before that fix.
FASTMATH = {"reassoc", "nsz"}


@functools.lru_cache(maxsize=None)
def _source_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


_cache_note_said = False


def _say_once(message: str) -> None:
    global _cache_note_said
    if not _cache_note_said:
        _cache_note_said = True
        print(f"fermijit: {message}", file=sys.stderr)


def _source_keyed_cache(body, extra: tuple) -> "SourceKeyedCache | None":
    """Numba's cache needs a writable place: the package's __pycache__, NUMBA_CACHE_DIR or the
    user's cache folder. A read-only install with no writable HOME has none, and every model
    command died at import. Then fall back to a private folder in the temp
    directory, and failing that run uncached (compiling every run); said once on stderr."""
    try:
        return SourceKeyedCache(body, extra)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        pass
    if not numba_config.CACHE_DIR:
        folder = private_cache_dir()
        if folder is not None:
            numba_config.CACHE_DIR = str(folder)
        try:
            cache = SourceKeyedCache(body, extra)
            _say_once(f"kernels are cached in {numba_config.CACHE_DIR} (the package folder "
                      f"and Numba's user cache are not writable)")
            return cache
        except RuntimeError:
            pass
    _say_once("no writable folder for Numba's cache: kernels are compiled on every run "
              "(set NUMBA_CACHE_DIR to a writable folder)")
    return None


def bind(fn, name: str = "", **bindings):
    """A copy of `fn` whose globals named in `bindings` are replaced (no closure: Numba can
    cache what calls it), called `<qualname>__<name>`.

    The name matters: Numba names compiled code by module, function name, a per-process counter
    and argument types, so two variants of one function compiled in two processes can carry the
    same symbol; loaded side by side from the cache, the first then served both (AVX2 GEMMs ran
    AVX-512 code). Give every variant its own `name`.
    """
    if not bindings and not name:
        return fn
    fn_globals = dict(fn.__globals__, **bindings) if bindings else fn.__globals__
    body = type(fn)(fn.__code__, fn_globals, fn.__name__, fn.__defaults__, fn.__closure__)
    body.__module__ = fn.__module__
    escaped = re.sub(r"\W", lambda m: f"_{ord(m.group()):x}_", name)  # a-b and a_b differ
    body.__qualname__ = fn.__qualname__ + ("__" + escaped if name else "")
    return body


_kernel_flags: dict[str, str] = {}  # module.qualname of each kernel made -> its flags


def kernel(fn=None, *, parallel: bool = False, fastmath=FASTMATH, variant: str = "",
           signatures=(), **bindings):
    """`numba.njit` with a source-keyed disk cache.

    With `signatures`, those are compiled (or loaded) on their first use and no others ever: a
    call with other argument types is a TypeError from Numba's dispatch, before any code runs.

    `bindings` replace globals of `fn`: this is how one kernel body becomes a variant per ISA
    (e.g. `row_dot=make_row_dot(Isa.AVX2)`) without closures, which Numba cannot cache. `variant`
    names the binding in the cache key and in the compiled code's symbols (see `bind`).
    """
    if bindings and not variant:
        raise ValueError("a kernel with bindings needs a variant name")

    def wrap(fn):
        body = bind(fn, variant, **bindings)
        flags = f"parallel={parallel} fastmath={sorted(fastmath) if fastmath else fastmath}"
        name = f"{body.__module__}.{body.__qualname__}"
        if _kernel_flags.setdefault(name, flags) != flags:  # the same symbols, other code
            raise ValueError(f"{name} is a kernel already ({_kernel_flags[name]}): give this one "
                             f"a variant name of its own")
        dispatcher = Dispatcher(py_func=body, locals={}, targetoptions=dict(
            nopython=True, boundscheck=None, parallel=parallel, fastmath=fastmath,
            error_model="numpy", nogil=True))
        folder = Path(fn.__code__.co_filename).resolve().parent
        # The two digests first: the code's version in the key (dispatch.KEY_VERSION)
        extra = (_source_digest(folder), _source_digest(_JIT_DIR), variant, flags)
        cache = _source_keyed_cache(body, extra)
        if cache is not None:
            dispatcher._cache = cache
        dispatcher.declare(signatures)
        return dispatcher

    return wrap(fn) if fn is not None else wrap
