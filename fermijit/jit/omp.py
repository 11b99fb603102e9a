"""One OpenMP fork per launch, for the kernels decode calls hundreds of times a token.

A Numba `prange` launch costs ~0.9 us here besides dispatch, twice libgomp's own fork and join
(0.45 us: a C loop of empty `omp parallel` regions on this machine), because Numba's parfor
computes a schedule and runs an `omp for` with a barrier of its own inside the region. On a cold
512x2048 GEMV (~16 us) the difference is 4 %. `fork` calls `GOMP_parallel` directly, on the
runtime Numba's omp layer has loaded, so both use one pool of threads.

Every fork can account for its time (`Regions`, off unless asked: one load and branch a launch):
the calling thread's wall time around the region and each thread's time in its share, read with
the cycle counter. `bench decode --profile` splits a token's kernel time into work, threads idle
inside regions (waiting for the slowest share) and fork/join.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc import parallel as numba_parallel

from fermijit import FermijitError, env_number
from fermijit.jit.cpu import FASTMATH, bind, configure_threads, kernel

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VOID_P = ir.IntType(8).as_pointer()
LIBGOMP = "libgomp.so.1"

# The regions' counters, int64, in memory the kernels reach through a symbol (resolved when a
# kernel is linked, so cached kernels find this process's copy): a header, then one cache line
# per thread (its share's cycles, then the cycle its share ended), so threads never share a line.
STATS_SYMBOL = "fermijit_omp_regions"
ON, REGIONS, WALL, SHARE_MAX, BUSY_MEAN, BUSY_SUM, WAIT_MEAN = range(7)
SLOT = 8                     # int64s a thread: one 64-byte line
MAX_TEAM = 1024
_stats = np.zeros(SLOT * (MAX_TEAM + 1), np.int64)  # the header takes the first line
llvm.add_symbol(STATS_SYMBOL, _stats.ctypes.data)


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


def _stats_word(builder, index):
    """A pointer to int64 `index` of the regions' counters (a value or a constant)."""
    module = builder.module
    table = module.globals.get(STATS_SYMBOL)
    if table is None:
        table = ir.GlobalVariable(module, ir.ArrayType(_I64, _stats.size), STATS_SYMBOL)
        table.linkage = "external"
    if isinstance(index, int):
        index = ir.Constant(_I64, index)
    return builder.gep(table, [ir.Constant(_I32, 0), index])


def _cycles(builder):
    fn = builder.module.declare_intrinsic("llvm.readcyclecounter",
                                          fnty=ir.FunctionType(_I64, []))
    return builder.call(fn, [])


def _slot(builder, thread):
    """Thread `thread`'s share cycles (its own line, after the header's)."""
    return _stats_word(builder, builder.mul(builder.add(thread, ir.Constant(_I64, 1)),
                                            ir.Constant(_I64, SLOT)))


def _end_slot(builder, thread):
    """The cycle thread `thread`'s share ended (its line's second word)."""
    return _stats_word(builder, builder.add(builder.mul(builder.add(thread, ir.Constant(_I64, 1)),
                                                        ir.Constant(_I64, SLOT)),
                                            ir.Constant(_I64, 1)))


def _is_on(builder):
    return builder.icmp_signed("!=", builder.load(_stats_word(builder, ON)), ir.Constant(_I64, 0))


def _add(builder, ptr, value):
    builder.store(builder.add(builder.load(ptr), value), ptr)


def _omp_int(builder, name: str):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, []), name)
    return builder.sext(builder.call(fn, []), _I64)


def _account(builder, team, wall):
    """After a region (on the calling thread, counting on): its wall cycles, the longest share,
    the threads' mean and total share cycles, their mean wait from the end of their share to the
    last share's end (a thread that started late, and took fewer of a chunked share's runs,
    waits less: its late start is the fork's); the slots reset."""
    c = lambda n: ir.Constant(_I64, n)  # noqa: E731
    longest = cgutils.alloca_once_value(builder, c(0))
    busy = cgutils.alloca_once_value(builder, c(0))
    last_end = cgutils.alloca_once_value(builder, c(0))
    wait = cgutils.alloca_once_value(builder, c(0))
    with cgutils.for_range(builder, team) as loop:
        share_ptr = _slot(builder, loop.index)
        share = builder.load(share_ptr)
        _add(builder, busy, share)
        builder.store(c(0), share_ptr)  # a thread left out of a later team counts nothing
        old = builder.load(longest)
        builder.store(builder.select(builder.icmp_signed(">", share, old), share, old), longest)
        end = builder.load(_end_slot(builder, loop.index))
        old = builder.load(last_end)
        builder.store(builder.select(builder.icmp_signed(">", end, old), end, old), last_end)
    with cgutils.for_range(builder, team) as loop:
        _add(builder, wait, builder.sub(builder.load(last_end),
                                        builder.load(_end_slot(builder, loop.index))))
    total = builder.load(busy)
    _add(builder, _stats_word(builder, WAIT_MEAN), builder.sdiv(builder.load(wait), team))
    _add(builder, _stats_word(builder, REGIONS), c(1))
    _add(builder, _stats_word(builder, WALL), wall)
    _add(builder, _stats_word(builder, SHARE_MAX), builder.load(longest))
    _add(builder, _stats_word(builder, BUSY_MEAN), builder.sdiv(total, team))
    _add(builder, _stats_word(builder, BUSY_SUM), total)


def _unowned(context, builder, ty, value):
    """`value` (of Numba type `ty`) with every array in it stripped of its owner (meminfo and
    parent null), for the threads of a fork. Each view a share makes of an argument, and each
    call passing one, counts a reference on the argument's meminfo: an atomic add on one cache
    line shared by every thread. Decode attention at 16k keys makes ~10k of them a call, and on
    16 threads its shares took 2.3x the one-thread work (H200 host). A null meminfo makes those
    counts a test and a branch (NRT_incref/NRT_decref skip it); the caller keeps the arrays
    alive until the join. Shares never return or store an argument's view."""
    if isinstance(ty, types.Array):
        ary = context.make_array(ty)(context, builder, value)
        ary.meminfo = cgutils.get_null_value(ary.meminfo.type)
        ary.parent = cgutils.get_null_value(ary.parent.type)
        return ary._getvalue()
    if isinstance(ty, types.BaseTuple):
        for i, item in enumerate(ty.types):
            value = builder.insert_value(value, _unowned(context, builder, item,
                                                         builder.extract_value(value, i)), i)
    return value


def fork(share, capped: bool = False, chunked: bool = False):
    """An intrinsic `fork(args)`: `share(thread, n_threads, args)` on each thread of one OpenMP
    team of Numba's thread count (`numba.set_num_threads`; args: a tuple; `share`: a plain
    function, compiled in nopython mode). Returns when every thread has finished. Without omp
    (`available()`), a team of one. `capped`: the intrinsic is `fork(cap, args)`, shares for at
    most `cap` threads (at least one), for work of few items: `share(thread, cap, args)` on the
    first `cap` threads, the others back at once. The team itself stays whole (but for a cap of
    one: the calling thread alone): libgomp ends the pool threads a smaller team leaves out, and
    the next whole team creates them again (~300 us a fork of 16 threads on the H200's host; an
    attention layer's capped fork of 2 items did it every token). `chunked`: the share is
    `share(thread, n_threads, args, counter)`, `counter` the launch's own work counter (zero at
    the fork, on a cache line of its own) for `first_run` / `next_run`.

    `share` must not raise: nothing propagates out of a thread (check inputs before the fork).
    Include `available()` in the cache key of kernels that use it: their code differs."""
    use_omp = available()

    def codegen(context, builder, sig, llargs):
        args_type, args = sig.args[-1], llargs[-1]
        share_sig = types.none(types.int64, types.int64, args_type,
                               *((types.voidptr,) if chunked else ()))
        # Not looked up by code object: the same `share` code is bound to other tiles per
        # ISA. (Numba still files the result under that key; nothing here reads it back.)
        share_fn = context.compile_subroutine(builder, share, share_sig, caching=False)

        def run_share(b, thread, team, packed, counter):
            context.call_internal_no_propagate(b, share_fn.fndesc, share_sig,
                                               [thread, team, packed] + [counter] * chunked)

        # The launch's work counter: zeroed here, before every fork of this call site; alone on
        # its cache line (the threads' atomic adds would otherwise bounce the arguments' line).
        counter = None
        if chunked:
            line = cgutils.alloca_once(builder, ir.ArrayType(_I64, SLOT))
            line.align = 8 * SLOT
            counter = builder.bitcast(line, _VOID_P)
            builder.store(ir.Constant(_I64, 0), builder.bitcast(line, _I64.as_pointer()))
        if not use_omp:
            run_share(builder, ir.Constant(_I64, 0), ir.Constant(_I64, 1), args, counter)
            return context.get_dummy_value()
        module = builder.module
        outlined_ty = ir.FunctionType(ir.VoidType(), [_VOID_P])
        outlined = ir.Function(module, outlined_ty, module.get_unique_name("omp_share"))
        outlined.linkage = "internal"
        b = ir.IRBuilder(outlined.append_basic_block("entry"))
        # The region's data: the threads with shares (the team, or the cap), the arguments.
        data_ty = ir.LiteralStructType([_I64, args.type, _VOID_P])
        data = b.bitcast(outlined.args[0], data_ty.as_pointer())
        zero = ir.Constant(_I32, 0)
        sharing = b.load(b.gep(data, [zero, zero]))
        packed = b.load(b.gep(data, [zero, ir.Constant(_I32, 1)]))
        shared_counter = b.load(b.gep(data, [zero, ir.Constant(_I32, 2)]))
        thread = _omp_int(b, "omp_get_thread_num")
        start = _cycles(b)
        with b.if_then(b.icmp_signed("<", thread, sharing)):
            run_share(b, thread, sharing, packed, shared_counter)
        with b.if_then(_is_on(b)):
            end = _cycles(b)
            b.store(b.sub(end, start), _slot(b, thread))
            b.store(end, _end_slot(b, thread))
        b.ret_void()

        # Numba's own symbol for its thread count (numba.get_num_threads() in a kernel goes
        # through a ctypes pointer, which makes the kernel uncacheable).
        team = builder.call(cgutils.get_or_insert_function(
            module, ir.FunctionType(_I64, []), "get_num_threads"), [])
        sharing = team
        if capped:
            one = ir.Constant(_I64, 1)
            cap = context.cast(builder, llargs[0], sig.args[0], types.int64)
            cap = builder.select(builder.icmp_signed("<", cap, one), one, cap)
            sharing = builder.select(builder.icmp_signed("<", cap, team), cap, team)
            team = builder.select(builder.icmp_signed("==", sharing, one), one, team)
        slot = cgutils.alloca_once(builder, data_ty)
        builder.store(sharing, builder.gep(slot, [ir.Constant(_I32, 0), ir.Constant(_I32, 0)]))
        builder.store(_unowned(context, builder, args_type, args),
                      builder.gep(slot, [ir.Constant(_I32, 0), ir.Constant(_I32, 1)]))
        builder.store(counter if chunked else ir.Constant(_VOID_P, None),
                      builder.gep(slot, [ir.Constant(_I32, 0), ir.Constant(_I32, 2)]))
        gomp_parallel = cgutils.get_or_insert_function(
            module, ir.FunctionType(ir.VoidType(), [outlined_ty.as_pointer(), _VOID_P,
                                                    _I32, _I32]), "GOMP_parallel")
        start = _cycles(builder)
        builder.call(gomp_parallel, [outlined, builder.bitcast(slot, _VOID_P),
                                     builder.trunc(team, _I32), ir.Constant(_I32, 0)])
        with builder.if_then(_is_on(builder)):
            _account(builder, team, builder.sub(_cycles(builder), start))
        return context.get_dummy_value()

    if capped:
        @intrinsic
        def fork_capped(typingctx, cap, args):
            return types.none(cap, args), codegen

        return fork_capped

    @intrinsic
    def fork_(typingctx, args):
        return types.none(args), codegen

    return fork_


@intrinsic
def team_size(typingctx):
    """The team a `fork` here would start: Numba's thread count (its symbol, as `fork` reads it;
    without omp the fork runs a team of one whatever this says)."""
    def codegen(context, builder, sig, args):
        return builder.call(cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I64, []), "get_num_threads"), [])

    return types.int64(), codegen


# Dynamic shares (`fork`'s `chunked`): a thread takes its equal run of the first STATIC_PERCENT
# of a launch's units (rows, or jobs: one long stream each, as the static split), then claims
# runs of the rest from the launch's work counter until none are left, so threads that stream
# faster take more (issue 29: on 16 threads some threads streamed ~1.5x slower than others on a
# loaded memory system; 6.3 of a 30 ms token was threads idle inside regions). Guided: each claim
# takes 1/(GUIDE x team) of the units left, at least the share's `least` (CHUNK_BYTES of weights:
# each run restarts the tile's side-by-side streams and their prefetch), so the first runs are
# long and the last ones short enough to balance. A team of one runs [0, n) as before. Every
# unit is computed by the same arithmetic whichever thread or run takes it. The defaults are
# not measured at 16 threads yet (tests/dynamic_shares_pass.sh sweeps them).
GUIDE = 2
CHUNK_BYTES = 32 << 10
STATIC_PERCENT = 50
# Decode's shares claim runs in teams of at least CLAIMS_FROM_TEAM threads; smaller teams take
# the static equal runs. Claimed runs paid for themselves on the GPU machine's 16-core host
# (Emerald Rapids, full-size reap128, 3 interleaved fresh-process rounds of `bench decode
# --threads-sweep 8,16`, session 25: at 8 threads 27.0 against 20.0 tok/s static, medians; at 16
# 1.198x in one process, session 20) but not on the 2-core Zen 5 at 2 threads: the fused MoE's
# 40 layers cold 16.2-16.5 ms claimed against 14.6-14.8 static (11 rounds a probe, three
# probes; 14.4 against 11.1 in a fast-bandwidth phase), a decode token 49.4 against 47.9 ms
# (512 + 64 tokens, 5 interleaved fresh-process rounds, medians), and with a busy neighbour on
# one core the two alike (95-98 ms). 3 to 7 threads unmeasured: claimed, as the many-core side.
# (Not the prefill's claims: prefill_first.)
CLAIMS_FROM_TEAM = 3
SCHEDULE_SYMBOL = "fermijit_omp_schedule"
# The schedule's words, read by the kernels per launch.
DYNAMIC, GUIDE_WORD, CHUNK_WORD, STATIC_WORD, CLAIM_PREFILL_WORD, TEAM_WORD = range(6)
_schedule = np.zeros(SLOT, np.int64)
_schedule[[DYNAMIC, GUIDE_WORD, CHUNK_WORD, STATIC_WORD]] = 1, GUIDE, CHUNK_BYTES, STATIC_PERCENT
llvm.add_symbol(SCHEDULE_SYMBOL, _schedule.ctypes.data)
# FERMIJIT_STATIC_SHARES=1: the static equal runs from the start, in every team and in prefill
# too; FERMIJIT_CLAIMS_FROM_TEAM=N: decode's shares claim in teams of N threads or more (1:
# every team). A/Bs of the schedules in fresh processes: tests/dynamic_shares_pass.sh.
STATIC_ENV = "FERMIJIT_STATIC_SHARES"
TEAM_ENV = "FERMIJIT_CLAIMS_FROM_TEAM"
if os.environ.get(STATIC_ENV, "") not in ("", "0"):
    _schedule[DYNAMIC] = 0


_schedule[TEAM_WORD] = max(1, env_number(TEAM_ENV, CLAIMS_FROM_TEAM, int))


def set_dynamic(on: bool, guide: int | None = None, chunk_bytes: int | None = None,
                static_percent: int | None = None, from_team: int | None = None) -> tuple:
    """Chunked shares claim runs dynamically (True, the default: decode's in teams of at least
    `from_team` threads, CLAIMS_FROM_TEAM unless given) or take the static equal run thread * n
    // team (where rows were placed for their thread's node: `--numa rows`); `guide`,
    `chunk_bytes` and `static_percent` (if given) replace GUIDE, CHUNK_BYTES and STATIC_PERCENT
    (tuning: tests/dynamic_shares_ab.py). Between launches only. Returns the previous (on, guide,
    chunk_bytes, static_percent, from_team)."""
    previous = (bool(_schedule[DYNAMIC]), *(int(_schedule[i]) for i in
                                            (GUIDE_WORD, CHUNK_WORD, STATIC_WORD, TEAM_WORD)))
    _schedule[DYNAMIC] = int(bool(on))
    for word, value, low, high in ((GUIDE_WORD, guide, 1, 1 << 20),
                                   (CHUNK_WORD, chunk_bytes, 1, 1 << 40),
                                   (STATIC_WORD, static_percent, 0, 100),
                                   (TEAM_WORD, from_team, 1, MAX_TEAM + 1)):
        if value is not None:
            _schedule[word] = min(max(low, int(value)), high)
    return previous


@intrinsic
def _schedule_word(typingctx, index):
    def codegen(context, builder, sig, args):
        module = builder.module
        table = module.globals.get(SCHEDULE_SYMBOL)
        if table is None:
            table = ir.GlobalVariable(module, ir.ArrayType(_I64, _schedule.size), SCHEDULE_SYMBOL)
            table.linkage = "external"
        return builder.load(builder.gep(table, [ir.Constant(_I32, 0), args[0]]))

    return types.int64(types.int64), codegen


@intrinsic
def _counter_now(typingctx, counter):
    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(args[0], _I64.as_pointer())
        return builder.load_atomic(ptr, "monotonic", 8)

    return types.int64(types.voidptr), codegen


@intrinsic
def _counter_add(typingctx, counter, n):
    """The counter's value before adding n (atomically)."""
    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(args[0], _I64.as_pointer())
        return builder.atomic_rmw("add", ptr, args[1], "monotonic")

    return types.int64(types.voidptr, types.int64), codegen


@kernel
def least_units(unit_bytes):
    """The fewest units a claimed run takes: CHUNK_BYTES of them (at least one)."""
    return max(1, _schedule_word(CHUNK_WORD) // max(1, unit_bytes))


@kernel
def static_units(n):
    """Of a chunked share's n units, the first ones split in static equal runs (STATIC_PERCENT):
    the rest is the pool the threads claim runs from."""
    return n * _schedule_word(STATIC_WORD) // 100


@kernel
def _claim(counter, n_threads, n, least, step):
    base = static_units(n)
    left = n - base - _counter_now(counter)
    size = max(least, left // (_schedule_word(GUIDE_WORD) * n_threads), 1)
    size = (size + step - 1) // step * step
    first = base + _counter_add(counter, size)
    return min(first, n), min(first + size, n)


# CPU prefill's GEMMs (ops/gemm.py: the dense product's row groups, the grouped experts' jobs)
# claim their work too (first_run / next_run), in at most FINE units a thread: a thread of a
# static split idled while others finished experts of more tokens (routing loads experts
# unevenly, and a job's packing costs ~6 tokens' tiles whatever its tokens) or ran slower. The
# guided claims end in runs of one unit, so a thread waits for at most about one unit at the end:
# 1/FINE of its share (8: up to 12 %, 32: 3 %). A unit is whole row groups (or the jobs starting
# in its work), so every output element has the same arithmetic whichever thread takes it.
# FERMIJIT_PREFILL_CLAIM=0: the static split as before (an A/B in fresh processes:
# tests/prefill_shares_pass.sh).
FINE = 32
CLAIM_PREFILL_ENV = "FERMIJIT_PREFILL_CLAIM"
_schedule[CLAIM_PREFILL_WORD] = int(os.environ.get(CLAIM_PREFILL_ENV, "1") != "0")


def set_prefill_claim(on: bool) -> bool:
    """Prefill's GEMMs claim fine units (True, the default) or take the static split; between
    launches only. Returns the previous setting."""
    previous = bool(_schedule[CLAIM_PREFILL_WORD])
    _schedule[CLAIM_PREFILL_WORD] = int(bool(on))
    return previous


@kernel
def prefill_claims():
    """Whether prefill's GEMMs claim their runs (`set_prefill_claim`)."""
    return _schedule_word(CLAIM_PREFILL_WORD) != 0


@kernel
def fine_units(n, n_threads):
    """The units a claimed launch cuts its n items into: FINE a thread (at most n, at least
    one); unit u holds items [u·n // units, (u+1)·n // units)."""
    return max(1, min(n, FINE * n_threads))


@kernel
def prefill_first(counter, thread, n_threads, n):
    """A prefill GEMM share's first run [first, last) of its n items (empty: none): its first
    claimed run of fine units (`first_run`), or with the claims off its static equal run."""
    if not prefill_claims():
        return thread * n // n_threads, (thread + 1) * n // n_threads
    units = fine_units(n, n_threads)
    u0, u1 = _claimed_first(counter, thread, n_threads, units, 1, 1)
    return u0 * n // units, u1 * n // units


@kernel
def prefill_next(counter, thread, n_threads, n):
    """The run after `prefill_first`'s and each one since (empty when the items are done)."""
    if not prefill_claims():
        return n, n
    units = fine_units(n, n_threads)
    u0, u1 = _claimed_next(counter, thread, n_threads, units, 1, 1)
    return u0 * n // units, u1 * n // units


@kernel
def first_run(counter, thread, n_threads, n, least, step):
    """A chunked share's first run [first, last) of its n units (empty: none left): the thread's
    static equal run of the first `static_units`, else claimed from the launch's `counter` (a
    multiple of `step` units, at least `least`); with `set_dynamic(False)`, or a team smaller
    than the schedule's `from_team` (CLAIMS_FROM_TEAM), the static equal run of all of them."""
    if n_threads < max(2, _schedule_word(TEAM_WORD)):
        return thread * n // n_threads, (thread + 1) * n // n_threads
    return _claimed_first(counter, thread, n_threads, n, least, step)


@kernel
def next_run(counter, thread, n_threads, n, least, step):
    """The run after `first_run`'s and each one since (empty when the units are done)."""
    if n_threads < max(2, _schedule_word(TEAM_WORD)):
        return n, n
    return _claimed_next(counter, thread, n_threads, n, least, step)


@kernel
def _claimed_first(counter, thread, n_threads, n, least, step):
    """`first_run` in any team of two or more (prefill's claims: every team)."""
    if n_threads <= 1 or _schedule_word(DYNAMIC) == 0:
        return thread * n // n_threads, (thread + 1) * n // n_threads
    base = static_units(n)
    first, last = thread * base // n_threads, (thread + 1) * base // n_threads
    if first < last:
        return first, last
    return _claim(counter, n_threads, n, least, step)


@kernel
def _claimed_next(counter, thread, n_threads, n, least, step):
    if n_threads <= 1 or _schedule_word(DYNAMIC) == 0:
        return n, n
    return _claim(counter, n_threads, n, least, step)


@intrinsic
def _read_cycles(typingctx):
    return types.int64(), lambda context, builder, sig, args: _cycles(builder)


@functools.lru_cache(maxsize=None)
def cycles_per_second() -> float:
    """The cycle counter's rate (the TSC's: constant on the CPUs this runs on), measured once
    against the monotonic clock over ~50 ms."""
    read = numba.njit(lambda: _read_cycles())
    read()
    c0, t0 = read(), time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        pass
    return (read() - c0) / (time.perf_counter() - t0)


@dataclass(frozen=True)
class Regions:
    """The parallel regions counted since `Regions.start()`, in seconds: the calling thread's wall
    time inside them (`wall_s`), of which the longest share of each (`share_max_s`); the threads'
    mean time in their shares (`busy_mean_s`) and their total (`busy_s`); their mean wait from
    the end of their share to the end of the region's last (`wait_mean_s`)."""

    count: int
    wall_s: float
    share_max_s: float
    busy_mean_s: float
    busy_s: float
    wait_mean_s: float

    @staticmethod
    def start() -> None:
        """Zero the counters and count every region from now on, until `stop`."""
        _stats[:] = 0
        _stats[ON] = 1

    @staticmethod
    def stop() -> "Regions":
        """Stop counting; what was counted."""
        _stats[ON] = 0
        return Regions.now()

    @staticmethod
    def now() -> "Regions":
        """What was counted so far (counting goes on); differences of two: the regions between."""
        hz = cycles_per_second()
        return Regions(int(_stats[REGIONS]), *(float(_stats[i]) / hz for i in
                                              (WALL, SHARE_MAX, BUSY_MEAN, BUSY_SUM,
                                               WAIT_MEAN)))

    def __sub__(self, other: "Regions") -> "Regions":
        return Regions(*(getattr(self, f) - getattr(other, f) for f in _FIELDS))

    def __add__(self, other: "Regions") -> "Regions":
        return Regions(*(getattr(self, f) + getattr(other, f) for f in _FIELDS))

    @property
    def idle_s(self) -> float:
        """Threads idle inside regions (waiting for the slowest share to end), per thread. Where
        every thread starts at once, the longest share minus the mean share; a thread that starts
        late (and of a chunked share takes fewer runs) counts its late start as the fork's."""
        return self.wait_mean_s

    @property
    def fork_join_s(self) -> float:
        """The rest of the calling thread's time in regions, per thread: the fork (the threads'
        starts) and the join."""
        return self.wall_s - self.busy_mean_s - self.wait_mean_s


_FIELDS = ("count", "wall_s", "share_max_s", "busy_mean_s", "busy_s", "wait_mean_s")


def forking_kernel(body, fastmath=FASTMATH, capped=(), chunked=(), **shares):
    """A function returning `cpu.kernel(body)` whose globals named in `shares` are `fork`
    intrinsics over those share functions (the omp variant where Numba's omp layer runs, else a
    team of one), made on its first call: making it starts the OpenMP threads. A share is compiled
    into the kernel, under the kernel's `fastmath`: False where a share's sums must keep their
    order (Numba's fast-math pass flags every float operation of the module). The shares named
    in `capped` are `fork(cap, args)` intrinsics (`fork`'s `capped`), those in `chunked` take the
    launch's work counter (`fork`'s `chunked`)."""
    made = []

    def get():
        if not made:
            variant = "omp" if available() else "serial"
            forks = {name: fork(bind(share, variant), name in capped, name in chunked)
                     for name, share in shares.items()}
            made.append(kernel(body, fastmath=fastmath, variant=variant, **forks))
        return made[0]

    return get


# Rows below which a caller of `rows_share` runs them on its own thread: a fork costs ~1 us on 2
# threads, ~5 us on 16, a row of the router, the GDN gates or RoPE well under 1 us.
ROWS_MIN = 32


def _rows_share(thread, n_threads, args):
    n_rows = args[0].shape[0]
    rows_range(*args, thread * n_rows // n_threads, (thread + 1) * n_rows // n_threads)


def rows_share(rows_range, name: str):
    """A `fork` share calling `rows_range(*args, first, last)` on the thread's equal run [first,
    last) of the rows of args[0] (its first axis): for prefill's kernels of independent rows (the
    router, the GDN gates, RoPE, the query | gate split), each row's arithmetic whatever the run,
    so the same bits at every thread count and as the one-thread call `rows_range(*args, 0, n)`.
    `name`: the op's, its own (`bind`). A row that makes many array views is a poor fit:
    kv_quant.store (~40 slices a row) ran 3x slower over 2 threads than on one, likely the views'
    shared reference counts."""
    return bind(_rows_share, name, rows_range=rows_range)


@kernel
def jobs_starting_in(lo, hi, done, n, count):
    """Of `count` jobs of weight n starting at done, done + n, ...: the range [first, end) of
    those that start in [lo, hi), a thread's equal share of a launch's work when jobs weigh
    differently (the grouped expert products of ops/matvec.py and ops/gemm.py)."""
    return max(0, (lo - done + n - 1) // n), min(count, (hi - done + n - 1) // n)
