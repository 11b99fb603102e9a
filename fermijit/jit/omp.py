"""One OpenMP fork per launch, for the kernels decode calls hundreds of times a token.

A Numba `prange` launch costs ~0.9 us here besides dispatch, twice libgomp's own fork and join
(0.45 us: a C loop of empty `omp parallel` regions on this machine), because Numba's parfor
computes a schedule and runs an `omp for` with a barrier of its own inside the region. On a cold
512x2048 GEMV (~16 us) the difference is 4 %. `fork` calls `GOMP_parallel` directly, on the
runtime Numba's omp layer has loaded, so both use one pool of threads.
"""

from __future__ import annotations

import functools
import os

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc import parallel as numba_parallel

from fermijit import FermijitError
from fermijit.jit.cpu import bind, configure_threads, kernel

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VOID_P = ir.IntType(8).as_pointer()
LIBGOMP = "libgomp.so.1"


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when Numba's threading layer is GNU OpenMP and libgomp's entry points can be linked
    into kernels (compiled or loaded from the cache). Otherwise `fork` runs a team of one."""
    configure_threads(None)          # the layer preference, before Numba launches its threads
    numba_parallel._launch_threads()  # private, but the public way is a first parallel launch
    if numba.threading_layer() != "omp":
        return False
    from numba.np.ufunc import omppool
    if getattr(omppool, "openmp_vendor", None) != "GNU":  # else libgomp would be a second pool
        return False
    try:
        llvm.load_library_permanently(LIBGOMP)  # already loaded by Numba: the same runtime
    except RuntimeError:
        return False
    return all(llvm.address_of_symbol(name) for name in
               ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads"))


# libgomp's threads do not survive fork(): a forking kernel called in a fork()ed child would hang
# (Numba's own launches stop the process with a message instead). `check_process` says so first.
in_forked_child = False


def _after_fork_in_child() -> None:
    global in_forked_child
    in_forked_child = available.cache_info().currsize > 0 and available()


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_process() -> None:
    """Raise in a fork()ed child of a process that set up libgomp for `fork` kernels."""
    if in_forked_child:
        raise FermijitError("fermijit's CPU kernels cannot run in a fork()ed child of a process "
                            "that used them (libgomp's threads do not survive fork); use "
                            "multiprocessing's 'spawn' start method")


def fork(share):
    """An intrinsic `fork(args)`: `share(thread, n_threads, args)` on each thread of one OpenMP
    team of Numba's thread count (`numba.set_num_threads`; args: a tuple; `share`: a plain
    function, compiled in nopython mode). Returns when every thread has finished. Without omp
    (`available()`), a team of one.

    `share` must not raise: nothing propagates out of a thread (check inputs before the fork).
    Include `available()` in the cache key of kernels that use it: their code differs."""
    use_omp = available()

    @intrinsic
    def fork_(typingctx, args):
        share_sig = types.none(types.int64, types.int64, args)

        def codegen(context, builder, sig, llargs):
            # Not looked up by code object: the same `share` code is bound to other tiles per
            # ISA. (Numba still files the result under that key; nothing here reads it back.)
            share_fn = context.compile_subroutine(builder, share, share_sig, caching=False)

            def run_share(b, thread, team, packed):
                context.call_internal_no_propagate(b, share_fn.fndesc, share_sig,
                                                   [thread, team, packed])

            if not use_omp:
                run_share(builder, ir.Constant(_I64, 0), ir.Constant(_I64, 1), llargs[0])
                return context.get_dummy_value()
            module = builder.module
            outlined_ty = ir.FunctionType(ir.VoidType(), [_VOID_P])
            outlined = ir.Function(module, outlined_ty, module.get_unique_name("omp_share"))
            outlined.linkage = "internal"
            b = ir.IRBuilder(outlined.append_basic_block("entry"))
            args_ty = llargs[0].type
            packed = b.load(b.bitcast(outlined.args[0], args_ty.as_pointer()))
            omp_int = ir.FunctionType(_I32, [])
            thread = b.call(cgutils.get_or_insert_function(module, omp_int,
                                                           "omp_get_thread_num"), [])
            team = b.call(cgutils.get_or_insert_function(module, omp_int,
                                                         "omp_get_num_threads"), [])
            run_share(b, b.sext(thread, _I64), b.sext(team, _I64), packed)
            b.ret_void()

            slot = cgutils.alloca_once(builder, args_ty)
            builder.store(llargs[0], slot)
            # Numba's own symbol for its thread count (numba.get_num_threads() in a kernel goes
            # through a ctypes pointer, which makes the kernel uncacheable).
            n_threads = builder.call(cgutils.get_or_insert_function(
                module, ir.FunctionType(_I64, []), "get_num_threads"), [])
            gomp_parallel = cgutils.get_or_insert_function(
                module, ir.FunctionType(ir.VoidType(), [outlined_ty.as_pointer(), _VOID_P,
                                                        _I32, _I32]), "GOMP_parallel")
            builder.call(gomp_parallel, [outlined, builder.bitcast(slot, _VOID_P),
                                         builder.trunc(n_threads, _I32), ir.Constant(_I32, 0)])
            return context.get_dummy_value()

        return types.none(args), codegen

    return fork_


def forking_kernel(body, **shares):
    """A function returning `cpu.kernel(body)` whose globals named in `shares` are `fork`
    intrinsics over those share functions (the omp variant where Numba's omp layer runs, else a
    team of one), made on its first call: making it starts the OpenMP threads."""
    made = []

    def get():
        if not made:
            variant = "omp" if available() else "serial"
            forks = {name: fork(bind(share, variant)) for name, share in shares.items()}
            made.append(kernel(body, variant=variant, **forks))
        return made[0]

    return get


@kernel
def jobs_starting_in(lo, hi, done, n, count):
    """Of `count` jobs of weight n starting at done, done + n, ...: the range [first, end) of
    those that start in [lo, hi), a thread's equal share of a launch's work when jobs weigh
    differently (the grouped expert products of ops/matvec.py and ops/gemm.py)."""
    return max(0, (lo - done + n - 1) // n), min(count, (hi - done + n - 1) // n)
