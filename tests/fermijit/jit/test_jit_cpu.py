"""CPU JIT machinery: variant choice, and kernels cached by source."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.jit import cpu

INTRINSIC_MODULE = textwrap.dedent("""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    VALUE = {value}

    @intrinsic
    def constant(typingctx):
        def codegen(context, builder, sig, args):
            return ir.Constant(ir.IntType(64), VALUE)
        return types.int64(), codegen
""")

KERNEL_MODULE = textwrap.dedent("""
    from fermijit.jit.cpu import kernel
    from cachedpkg.intrinsics import constant

    @kernel
    def read_constant():
        return constant()
""")

RUN = ("from cachedpkg.kernels import read_constant as f; r = f(); "
       "print(r, sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))")


def test_editing_an_intrinsic_recompiles_the_kernel_that_uses_it(tmp_path):
    """Numba's own cache keys a kernel on its file only; an edit to the intrinsic's module would
    be served the stale machine code. Ours must rebuild, and still hit the cache otherwise."""
    pkg = tmp_path / "cachedpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "intrinsics.py").write_text(INTRINSIC_MODULE.format(value=3))
    (pkg / "kernels.py").write_text(KERNEL_MODULE)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))

    def run():
        r = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        value, hits, misses = map(int, r.stdout.split())
        return value, hits, misses

    assert run() == (3, 0, 1)          # compiled and saved
    assert run() == (3, 1, 0)          # served from the disk cache
    (pkg / "intrinsics.py").write_text(INTRINSIC_MODULE.format(value=5))
    assert run() == (5, 0, 1)          # the edit took effect without clearing any cache
    assert run() == (5, 1, 0)


def test_default_is_the_best_supported_variant():
    best = cpu.selected_isa()
    assert cpu.supported(best)
    assert all(not cpu.supported(i) for i in cpu.PREFERENCE[:cpu.PREFERENCE.index(best)])
    assert cpu.variants_up_to(best)[-1] is cpu.Isa.SSSE3


def test_unknown_isa_is_a_clear_error():
    with pytest.raises(FermijitError, match="unknown ISA 'sse9'"):
        cpu.select_isa("sse9")


@pytest.fixture
def restore_isa():
    saved = cpu._selected, cpu._decode
    yield
    cpu._selected, cpu._decode = saved


def test_decode_runs_the_decode_variant_unless_told(restore_isa, monkeypatch):
    """One-token products run DECODE_VARIANT's narrower variant (256-bit code where the process
    runs AVX-512) where the CPU has it; --decode-isa chooses another; the process's is kept."""
    for isa in cpu.PREFERENCE[:-1]:  # not ssse3: choosing it switches the target to Westmere
        if not cpu.supported(isa):
            continue
        cpu.select_isa(isa.label)
        assert cpu.decode_isa() is cpu.DECODE_VARIANT.get(isa, isa)
        cpu.select_isa(isa.label, "ssse3")
        assert (cpu.selected_isa(), cpu.decode_isa()) == (isa, cpu.Isa.SSSE3)
    with pytest.raises(FermijitError, match="unknown ISA 'avx9'"):
        cpu.select_isa(None, "avx9")
    monkeypatch.setattr(cpu, "supported", lambda isa: isa is cpu.Isa.SSSE3)
    with pytest.raises(FermijitError, match="lacks avx2"):
        cpu.select_isa(None, "avx2")


def test_forcing_ssse3_after_a_compile_is_refused():
    """Numba's target is fixed by the first compile (notes, pitfall 2): say so, don't pretend."""
    from fermijit.ops import quant  # noqa: F401  (compiles kernels in this process)
    import numpy as np
    quant.quantize_q4_0_cpu(np.zeros((1, 32), np.float32))
    if cpu.target_cpu_name() == cpu.WESTMERE:
        pytest.skip("already on a Westmere target")
    with pytest.raises(FermijitError, match="before any kernel is compiled"):
        cpu.select_isa("ssse3")


def test_ssse3_forces_one_target_whatever_the_host_is_named():
    """`--isa ssse3` on a host that is already a Westmere (as `qemu -cpu Westmere` reports) forces
    the same target as elsewhere: an empty feature string, so Numba's cache key (which holds it)
    matches kernels cached natively; with the host's feature list each kernel compiled again
    under emulation (CI: 40 minutes)."""
    code = ("from numba.core import config; from fermijit.jit import cpu; cpu.select_isa('ssse3');"
            "print(repr(config.CPU_NAME), repr(config.CPU_FEATURES))")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(env, NUMBA_CPU_NAME="westmere"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["'westmere'", "''"]


def test_env_override_reaches_the_cli():
    r = subprocess.run([sys.executable, "-m", "fermijit", "info"], capture_output=True, text=True,
                       env=dict(os.environ, FERMIJIT_ISA="ssse3"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ssse3" in r.stdout and "westmere" in r.stdout


VARIANT_RUN = textwrap.dedent("""
    import sys
    import numpy as np
    from fermijit.jit.cpu import Isa
    from fermijit.ops import matvec, quant
    rng = np.random.default_rng(1)
    qs, d = quant.quantize_q4_0(rng.standard_normal((12, 512)).astype(np.float32))
    x = rng.standard_normal((9, 512)).astype(np.float32)
    ref = matvec.reference(qs, d, x)
    matvec.quantize_act(x)
    for label in sys.argv[1:]:  # the GEMM, then the GEMV
        y = matvec.cpu(qs, d, x, isa=Isa[label]), matvec.cpu(qs, d, x[0], isa=Isa[label])
        errs = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(y, (ref, ref[0]))]
        print(label, max(errs))
""")


def test_variants_compiled_in_different_processes_load_side_by_side(tmp_path):
    """Variants of one kernel body share its code. Numba names compiled code by module,
    function name and a per-process counter, so two variants compiled in two processes could load
    under one symbol, the first then serving both (it did: AVX2 products ran AVX-512 code)."""
    isas = [i.name for i in cpu.PREFERENCE if cpu.supported(i)][:2]
    if len(isas) < 2:
        pytest.skip("one kernel variant on this CPU")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("FERMIJIT_ISA", None)

    def run(*labels):
        r = subprocess.run([sys.executable, "-c", VARIANT_RUN, *labels], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        lines = (line.split() for line in r.stdout.splitlines())
        return {label: float(err) for label, err in lines}

    run()                               # what both need, so that each next process compiles
    run(isas[0])                        # just its variant, and in the same order: each alone,
    run(isas[1])                        # in a process of its own
    errors = run(*isas)                 # then both loaded from the cache into one process
    assert set(errors) == set(isas) and all(err < 1e-5 for err in errors.values()), errors


PINNED = textwrap.dedent("""
    import os, subprocess, sys
    from fermijit.jit import cpu
    cpu.pin_threads()
    cpu.configure_threads(None)
    from fermijit.ops import matvec
    matvec.warm_up()  # starts the team
    print(sorted(os.sched_getaffinity(0)))
    code = "import os, fermijit; print(sorted(os.sched_getaffinity(0)))"
    print(subprocess.run([sys.executable, "-c", code], env=cpu.child_env(),
                         capture_output=True, text=True).stdout.strip())
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to bind apart")
def test_pinned_threads_bind_the_caller_and_children_take_the_cpus_back():
    r = subprocess.run([sys.executable, "-c", PINNED], capture_output=True, text=True,
                       timeout=300, env={k: v for k, v in os.environ.items()
                                         if not k.startswith(("OMP_", "FERMIJIT_CPUS"))})
    assert r.returncode == 0, r.stderr[-2000:]
    caller, child = r.stdout.strip().splitlines()
    allowed = sorted(os.sched_getaffinity(0))
    assert len(eval(caller)) == 1          # the caller, thread 0 of every team, is bound
    assert eval(child) == allowed          # a child runs where the parent could


def test_decode_asks_llvm_for_the_host_features_once(monkeypatch):
    """The host's features are LLVM's answer once: asked per launch where decode picks a kernel
    by ISA (the embedded model's MoE, whose shared expert runs apart), ~120 us each made its
    tokens 14x slower."""
    import llvmlite.binding as llvm

    from fermijit import engine
    from fermijit.model.forward import load_model

    _, model = load_model(engine.DEFAULT_MODEL)
    state = model.new_state(16)
    model.prefill(np.arange(4, dtype=np.int32), state)
    model.decode(5, state)
    asked = []
    real = llvm.get_host_cpu_features
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: asked.append(1) or real())
    for _ in range(3):
        model.decode(5, state)
    assert asked == []


PASSING = """
import os, threading, time
import numpy as np
from fermijit.jit import cpu
cpu.configure_threads(2)
from fermijit.engine import DEFAULT_MODEL
from fermijit.model.forward import load_model

def tasks():  # threads Python did not start (libgomp's workers): the load's own come and go
    return len(os.listdir("/proc/self/task")) - threading.active_count()

_, model = load_model(DEFAULT_MODEL)
state = model.new_state(8)
before = tasks()
where = cpu.on_a_passing_thread(lambda: (model.prefill(np.arange(3, dtype=np.int32), state),
                                         threading.current_thread())[1])
deadline = time.monotonic() + 10  # the pool's workers leave after their thread has ended
while tasks() > before and time.monotonic() < deadline:
    time.sleep(0.01)
after_passing = tasks()
model.decode(5, state)  # the main thread's own kernels: its pool of workers stays
from fermijit.jit import omp
if not omp.available():
    print("no omp")
else:
    print(where is not threading.main_thread(), where.is_alive(), before, after_passing, tasks())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc to count threads in")
def test_work_on_a_passing_thread_leaves_no_pool_behind():
    """on_a_passing_thread: the work runs on a thread of its own, whose libgomp workers end with
    it (serve's warm-up, so that the scheduler thread's pool is the only one: two live pools
    throttle every idle worker's spin); the main thread's own kernels leave their workers for
    the process's life (what the passing thread avoids)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no team of two")
    r = subprocess.run([sys.executable, "-c", PASSING], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    if r.stdout.strip() == "no omp":
        pytest.skip("Numba's threading layer is not omp here")
    elsewhere, alive, before, after_passing, after_main = r.stdout.split()
    assert (elsewhere, alive) == ("True", "False")
    assert int(after_passing) == int(before) < int(after_main)


def test_a_passing_thread_returns_or_raises_and_keeps_the_thread_count():
    import numba

    n = cpu.configure_threads(None)
    assert cpu.on_a_passing_thread(numba.get_num_threads) == n
    with pytest.raises(FermijitError, match="boom"):
        cpu.on_a_passing_thread(lambda: (_ for _ in ()).throw(FermijitError("boom")))
