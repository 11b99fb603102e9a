"""jit/dispatch.py: declared signatures compiled on first use; compiles and cache saves shared
safely between processes using one cache folder (the warm-up's helpers, two first runs at once)."""

import ctypes
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import llvmlite.binding as llvm_binding
import numpy as np
import pytest
from numba import types
from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import cpu_target

from fermijit.jit import dispatch
from fermijit.jit.cpu import kernel


def _scale(x, out):
    for i in range(x.size):
        out[i] = x[i] * 2


_R = types.Array(types.float32, 1, "C", readonly=True)
_SCALE = kernel(_scale, variant="dispatch-test", signatures=[
    types.void(_R, types.Array(types.float32, 1, "C")),
    types.void(types.Array(types.int32, 1, "C", readonly=True), types.Array(types.int32, 1, "C"))])


def test_declared_signatures_compile_on_first_use_and_no_others():
    x = np.arange(5, dtype=np.float32)          # writable: converts to the read-only declared
    out = np.full(5, np.nan, np.float32)
    _SCALE(x, out)
    assert np.array_equal(out, 2 * x)
    assert [tuple(sig) for sig in _SCALE.overloads] == [(_R, types.Array(types.float32, 1, "C"))]
    with pytest.raises(TypeError, match="No matching definition"):
        _SCALE(x.astype(np.float64), out.astype(np.float64))
    assert len(_SCALE.overloads) == 1           # the refused call compiled nothing
    xi, outi = np.arange(5, dtype=np.int32), np.zeros(5, np.int32)
    _SCALE(xi, outi)
    assert np.array_equal(outi, 2 * xi) and len(_SCALE.overloads) == 2
    assert not _SCALE._can_compile              # all declared there: Numba's own dispatch
    with pytest.raises(TypeError):
        _SCALE(x.astype(np.float64), out.astype(np.float64))


def _scale_twice(x, out):
    for i in range(x.size):
        out[i] = x[i] * 2


def test_a_converted_call_does_not_come_back_through_python(monkeypatch):
    """Arguments converting to a declared signature (a writable array for a read-only one) take
    the compiled code straight from Numba's dispatch on later calls: while a kernel may still
    compile, its dispatch matches exact types only, and each such call went back through Python's
    compile path (~150 us a GEMV: decode 40 -> 50 ms a token on the REAP-128 model)."""
    scale = kernel(_scale_twice, variant="dispatch-test-converted", signatures=[
        types.void(_R, types.Array(types.float32, 1, "C")),
        types.void(types.Array(types.int32, 1, "C", readonly=True),
                   types.Array(types.int32, 1, "C"))])
    x, out = np.arange(5, dtype=np.float32), np.full(5, np.nan, np.float32)
    scale(x, out)                               # compiles (or loads) the float signature
    assert scale._can_compile                   # the int one is still to come
    slow = []
    original = dispatch.Dispatcher._compile_for_args
    monkeypatch.setattr(dispatch.Dispatcher, "_compile_for_args",
                        lambda self, *a, **k: slow.append(a) or original(self, *a, **k))
    out[:] = np.nan
    scale(x, out)
    assert np.array_equal(out, 2 * x) and slow == []


# A kernel with many signatures (the element type of its argument): two processes compile
# disjoint halves of them at once into one cache folder, then a third loads them all.
KERNELS = textwrap.dedent("""
    from fermijit.jit.cpu import kernel

    @kernel
    def plus_one(x):
        return x + 1
""")
TYPES = ["np.int8", "np.int16", "np.int32", "np.int64", "np.uint8", "np.uint16", "np.uint32",
         "np.uint64", "np.float32", "np.float64"]
COMPILE = """
import sys, time
import numpy as np
from cachedpkg.kernels import plus_one as f
while time.time() < float(sys.argv[1]):  # start together
    time.sleep(0.001)
for t in sys.argv[2:]:
    assert f(eval(t)(3)) == 4
print(sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))
"""


def _package(tmp_path):
    pkg = tmp_path / "cachedpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels.py").write_text(KERNELS)
    return dict(os.environ, PYTHONPATH=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "cache"))


def _concurrently(env, *type_lists):
    start = str(time.time() + 3)  # past both interpreters' start-up
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE, start, *types_], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for types_ in type_lists]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        results.append(tuple(map(int, out.split())))
    return results


def test_concurrent_saves_of_one_kernel_keep_every_signature(tmp_path):
    """Numba's index update is a read-modify-write: unlocked, two processes saving at once took
    the same data file, and an index entry could name the other signature's code."""
    env = _package(tmp_path)
    _concurrently(env, TYPES[::2], TYPES[1::2])
    (hits, misses), = _concurrently(env, TYPES)
    assert (hits, misses) == (len(TYPES), 0)  # each loaded, and each gave x + 1 (asserted)


def test_a_kernel_needed_by_two_processes_at_once_compiles_once(tmp_path):
    env = _package(tmp_path)
    results = _concurrently(env, TYPES, TYPES)
    assert sum(misses for _, misses in results) == len(TYPES), results
    assert sum(hits for hits, _ in results) == len(TYPES), results


SERVED = """
from numba.core.compiler import Flags
from cachedpkg.kernels import plus_one as f
assert f(3) == 4
(served,) = f.overloads.values()
print(sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()),
      "debuginfo=True" in Flags.demangle(served.fndesc.abi_tags[0]))
"""


def _served(env) -> tuple:
    """(cache hits, misses, whether the code it runs has debug info) of one call in a process."""
    r = subprocess.run([sys.executable, "-c", SERVED], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    hits, misses, debug = r.stdout.split()
    return int(hits), int(misses), debug == "True"


@pytest.mark.parametrize("setting", [{"NUMBA_DEBUGINFO": "1"}, {"NUMBA_ENABLE_PROFILING": "1"},
                                     {"NUMBA_OPT": "0"}])
def test_code_compiled_under_other_numba_settings_is_not_served_to_others(tmp_path, setting):
    """Numba's cache key leaves out the settings that change its code: one profiling run with
    NUMBA_DEBUGINFO=1 saved debug-info kernels that every later process of the worktree loaded
    (issue 9: the gated norm and SwiGLU 10-14x slower). A plain process compiles its own."""
    env = _package(tmp_path)
    other = _served(dict(env, **setting))
    assert other[:2] == (0, 1)
    assert _served(env) == (0, 1, False)
    assert _served(env) == (1, 0, False)        # plain code is cached as before
    assert _served(dict(env, **setting)) == (1, 0, other[2])  # and so is the other


def _index_entries(cache: Path) -> tuple[int, int]:
    """(entries in plus_one's cache index, its data files) under the cache folder `cache`."""
    (index,) = cache.rglob("*plus_one*.nbi")
    with open(index, "rb") as f:
        pickle.load(f)  # Numba's version
        _, overloads = pickle.loads(f.read())
    return len(overloads), len(list(cache.rglob("*plus_one*.nbc")))


def test_entries_of_another_version_of_the_source_are_dropped_at_the_next_save(tmp_path):
    """The kernel's folder edited (not its own file: Numba keeps the index then) makes a cache
    miss; the save drops the old version's entry and its data, which no load could hit again
    (kept, every edit or upgrade grew every index that each start unpickles)."""
    env = _package(tmp_path)
    assert _served(env)[:2] == (0, 1)
    (tmp_path / "cachedpkg" / "other.py").write_text("X = 1\n")  # the folder's digest moves
    assert _served(env)[:2] == (0, 1)
    assert _index_entries(tmp_path / "cache") == (1, 1)
    assert _served(env)[:2] == (1, 0)
    (tmp_path / "cachedpkg" / "other.py").unlink()  # back to the first version: dropped
    assert _served(env)[:2] == (0, 1)


HOLD = """
import sys, time
from fermijit.jit import dispatch
with dispatch.folder_lock(sys.argv[1], "some kernel") as held:
    print(held, flush=True)
    time.sleep(60)
"""


def test_a_lock_held_too_long_is_waited_for_a_bounded_time(tmp_path):
    """A helper that hangs holding a compile's lock delays the warm-up; it cannot stop it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        start = time.monotonic()
        with dispatch.folder_lock(str(tmp_path), "some kernel", wait_s=0.5) as held:
            assert not held
        assert 0.5 <= time.monotonic() - start < 5
        with dispatch.folder_lock(str(tmp_path), "another kernel", wait_s=0.5) as held:
            assert held
    finally:
        holder.kill()
        holder.wait()
    with dispatch.folder_lock(str(tmp_path), "some kernel", wait_s=5) as held:
        assert held  # freed by the holder's death


def _library(codegen, name, ir_text):
    library = codegen.create_library(name)
    library.add_llvm_module(llvm_binding.parse_assembly(ir_text))
    return library


def test_a_library_made_only_to_be_linked_gets_machine_code_only_when_asked():
    """Numba finalizes a library it links into another, machine code and all, though the caller
    links its own copy of the IR (a first run's compile: issue 9). Its code waits until asked."""
    codegen = cpu_target.target_context.codegen()
    callee = _library(codegen, "callee", """
        define i64 @fermijit_test_plus_one(i64 %x) {
          %y = add i64 %x, 1
          ret i64 %y
        }""")
    caller = _library(codegen, "caller", """
        declare i64 @fermijit_test_plus_one(i64)
        define i64 @fermijit_test_plus_two(i64 %x) {
          %y = call i64 @fermijit_test_plus_one(i64 %x)
          %z = add i64 %y, 1
          ret i64 %z
        }""")
    with global_compiler_lock:
        caller.add_linking_library(callee)
        assert callee._deferred_module is not None      # finalized for linking, no code yet
        plus_two = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(
            caller.get_pointer_to_function("fermijit_test_plus_two"))
        assert plus_two(40) == 42                       # its own copy of the callee
        assert callee._deferred_module is not None
        plus_one = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(
            callee.get_pointer_to_function("fermijit_test_plus_one"))
    assert plus_one(40) == 41 and callee._deferred_module is None  # asked: compiled now


def test_a_caller_calls_its_own_copy_of_what_it_links():
    """A caller's copy of a linked function was a weak symbol, resolved to the first definition
    of its name the JIT had: a library compiled alone under that name (issue 9: attention's
    range kernel, optimised again in its caller, other bits). Here the two differ on purpose."""
    codegen = cpu_target.target_context.codegen()
    which = "define i64 @fermijit_test_which() noinline {{ ret i64 {} }}"
    alone = _library(codegen, "alone", which.format(1))
    linked = _library(codegen, "linked", which.format(2))
    caller = _library(codegen, "caller", """
        declare i64 @fermijit_test_which()
        define i64 @fermijit_test_calls_which() {
          %y = call i64 @fermijit_test_which()
          ret i64 %y
        }""")
    with global_compiler_lock:
        alone.finalize()                                # in the JIT first, a strong definition
        caller.add_linking_library(linked)
        calls_which = ctypes.CFUNCTYPE(ctypes.c_int64)(
            caller.get_pointer_to_function("fermijit_test_calls_which"))
        assert calls_which() == 2
        shared = linked._get_module_for_linking()      # what others link: still linkonce_odr
    assert shared.get_function("fermijit_test_which").linkage == llvm_binding.Linkage.linkonce_odr


# Attention's shapes whose outputs differed between the process that compiled its kernels and the
# later ones that load them from the cache (T, Hq, Hkv, D, S, start): 8 query heads a kv head at
# head dim 256, one at head dim 32 (a decode step over two key ranges), 2 at head dim 48.
ATTENTION_SHAPES = [(40, 16, 2, 256, 300, 0), (1, 2, 2, 32, 300, 299), (150, 4, 2, 48, 200, 30)]
ATTENTION_RUN = textwrap.dedent("""
    import sys
    import numpy as np
    from fermijit.ops import attention
    rng = np.random.default_rng(0)
    outs = []
    for T, Hq, Hkv, D, S, start in eval(sys.argv[2]):
        q, gate = (rng.standard_normal((T, Hq, D), dtype=np.float32) for _ in range(2))
        k, v = (rng.standard_normal((Hkv, S, D), dtype=np.float32) for _ in range(2))
        outs.append(attention.cpu(q, k, v, gate, start))
    np.savez(sys.argv[1], *outs)
    stats = attention._kernel(None).stats  # the fp32 cache's kernel
    print(sum(stats.cache_misses.values()), sum(stats.cache_hits.values()))
""")


def test_kernels_loaded_from_the_cache_give_the_compiled_bits(tmp_path):
    """The process that compiles attention's kernel and a later one that loads it from the
    cache give the same bits (they did not: the test above)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def run(name):
        r = subprocess.run([sys.executable, "-c", ATTENTION_RUN, str(tmp_path / name),
                            repr(ATTENTION_SHAPES)], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return tuple(map(int, r.stdout.split())), np.load(tmp_path / name)

    (misses, _), compiled = run("compiled.npz")
    (misses_then, hits), loaded = run("loaded.npz")
    assert misses == 1 and (misses_then, hits) == (0, 1)
    other_bits = [shape for i, shape in enumerate(ATTENTION_SHAPES)
                  if not np.array_equal(compiled[f"arr_{i}"], loaded[f"arr_{i}"])]
    assert other_bits == []


SYMBOLS_RUN = textwrap.dedent("""
    import numpy as np
    import llvmlite.binding as llvm_binding
    from numba.core.registry import cpu_target
    from fermijit.jit import dispatch
    from tests.fermijit.jit.test_jit_dispatch import _SCALE

    x, out = np.arange(8, dtype=np.float32), np.full(8, np.nan, np.float32)
    _SCALE(x, out)  # compiled here (an empty cache folder): its object code is at hand
    compiled = next(iter(_SCALE.overloads.values()))
    library = compiled.library
    _, kind, (object_code, bitcode) = library.serialize_using_object_code()
    shared = llvm_binding.parse_bitcode(bitcode)
    own = set(getattr(library, "_own_copies", ()))
    hidden = (llvm_binding.Linkage.internal, llvm_binding.Linkage.private)
    numba_names = {g.name for gs in (shared.functions, shared.global_variables) for g in gs
                   if not g.is_declaration and g.linkage not in hidden and g.name not in own}
    names = dispatch.elf_defined_symbols(object_code)
    assert kind == "object" and names == numba_names, (names, numba_names)
    assert compiled.fndesc.llvm_cpython_wrapper_name in names  # what Numba asks the JIT for
    assert dispatch.elf_defined_symbols(b"\\x7fELF\\x01\\x01" + object_code[6:]) is None
    assert dispatch.elf_defined_symbols(object_code[:100]) is None  # cut short
    lazy = cpu_target.target_context.codegen().create_library("fermijit_test_lazy")
    lazy._lazy_shared_bitcode, lazy._finalized = bitcode, True  # as _unserialize leaves it
    module = lazy._get_module_for_linking()
    assert lazy._lazy_shared_bitcode is None and module is lazy._shared_module
    assert sorted(f.name for f in module.functions) == sorted(f.name for f in shared.functions)
    print("ok", len(names))
""")


def test_a_cached_kernel_s_symbols_come_from_its_object_code_and_its_bitcode_on_use(tmp_path):
    """dispatch._unserialize (issue 28 item 4: parsing every cached kernel's linking bitcode
    was 0.15 s of serve's warm-up): the names the JIT is told a loaded library defines, read from
    its object code's ELF symbols, are those Numba read from its linking module (less the own
    copies, internal in the object code), the entry Numba asks for among them; not ELF64, or cut
    short: None (Numba's way); the bitcode is parsed when something links it. (A library loaded
    from the cache has given its object code to the JIT: compiled in a process of its own.)"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", SYMBOLS_RUN], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-3000:]


LOAD_RUN = textwrap.dedent("""
    import sys
    import numpy as np
    from numba.core import base
    refreshes = []
    original = base.BaseContext.refresh
    base.BaseContext.refresh = lambda self: (refreshes.append(1), original(self))[1]
    from fermijit.engine import DEFAULT_MODEL, Engine, Settings
    from fermijit.jit import dispatch
    misses = []
    dispatch.on_miss = lambda: misses.append(1)
    engine = Engine.load(DEFAULT_MODEL)
    model, sampler = engine.model, engine.sampler(Settings(temperature=0.8, top_p=0.9, seed=3))
    state = model.new_state(16)
    logits = model.prefill(np.arange(5, 12, dtype=np.int32), state)
    token = sampler.sample(logits)
    logits2 = model.decode(token, state)
    np.savez(sys.argv[1], logits, logits2, np.array([token, sampler.sample(logits2)]))
    print(len(misses), len(refreshes))
""")


def test_kernels_loaded_without_numba_s_refresh_give_the_same_bits(tmp_path):
    """dispatch's load without Numba's context refresh (issue 28 item 4): a process loading the
    model's kernels (prefill, decode, sampling: Numba's runtime, its random generator) from the
    cache that way gives the bits of one loading them Numba's way (FERMIJIT_LOAD_REFRESH=1), and
    does refresh less (a load none)."""
    def run(name, refresh):
        env = dict(os.environ, FERMIJIT_LOAD_REFRESH=refresh)
        r = subprocess.run([sys.executable, "-c", LOAD_RUN, str(tmp_path / name)], env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        return tuple(map(int, r.stdout.split())), np.load(tmp_path / name)

    run("warm.npz", "1")  # the cache filled, if it was not
    (misses, refreshes), numba_way = run("numba.npz", "1")
    (misses_then, refreshes_then), ours = run("ours.npz", "0")
    assert misses == misses_then == 0
    assert refreshes_then < refreshes
    assert all(np.array_equal(numba_way[k], ours[k]) for k in numba_way.files)
