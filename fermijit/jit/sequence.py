"""Several compiled kernels called in turn from one dispatch: decode's plan runs a layer's
kernels (ops.residual_step, the GEMVs, ops.gdn_step, ops.moe...) as one call.

Why: a Numba dispatch costs ~1-3 us with its code and the arrays' Python objects in cache, but
decode streams ~1 GB of weights a token through the caches, and a dispatch after a kernel found
them cold: 15-25 us measured here (an empty kernel given a layer step's arguments after a 400 MB
sweep), ~5-15 us between a token's kernels. A full-size token made ~250 such calls, ~1.5-3 ms
at every thread count (the "serial" and "Python" columns of a 16-thread profile).

How: each kernel's own machine code (the code its dispatcher runs, compiled alone or loaded from
the cache) is called through its address, with Numba's calling convention, from a small kernel,
the runner: not linked and optimised again inside a caller (under fast-math a re-optimised copy
may round differently: jit/dispatch.py), so every call gives the bits of the call through its
own dispatcher. The addresses and the arguments are stored once in a buffer (`joined_step`), the
runner's one argument its address: one cached runner per tuple of argument types (decode's plan
joins a layer at a time: one per kind of layer, whatever the model's depth).

Measured (8 full-size layers, 2 threads; tokens of the plan joined and one by one interleaved in
one process, load ~1): a token's time outside the parallel regions 0.97 -> 0.53 ms; the full
size (40 layers, load ~2.5) 4.13 -> 2.12 ms, 1.8 % of the token (median of 30 pairs).

Only kernels that return nothing, compiled for the arguments' types (or read-only arrays where
they are writable), are joined (`callable_address`); anything else stays a call of its own.
"""

from __future__ import annotations

import hashlib

import numpy as np
from llvmlite import ir
from numba import typeof, types
from numba.core import cgutils
from numba.core.dispatcher import Dispatcher
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from fermijit.jit.cpu import kernel


def _emit_calls(context, builder, addresses, arguments, arguments_ty) -> None:
    """Call address i (int64 values) with the items of tuple i of `arguments` (a tuple value of
    type `arguments_ty`), Numba's calling convention, no return value, the status ignored:
    kernels do not raise."""
    call_conv = context.call_conv
    tuples = cgutils.unpack_tuple(builder, arguments)
    for address, items_ty, items in zip(addresses, arguments_ty.types, tuples):
        argtys = list(items_ty.types)
        fnty = call_conv.get_function_type(types.none, argtys)
        fn = builder.inttoptr(address, fnty.as_pointer())
        retty = call_conv.get_return_type(types.none).pointee
        retval = cgutils.alloca_once(builder, retty)
        builder.store(cgutils.get_null_value(retty), retval)
        excinfo = cgutils.alloca_once(builder, fnty.args[1].pointee, name="excinfo")
        packed = call_conv._get_arg_packer(argtys).as_arguments(
            builder, cgutils.unpack_tuple(builder, items))
        builder.call(fn, [retval, excinfo] + list(packed))


# --- a sequence held in native memory ------------------------------------------------------------
# Given as a tuple, a sequence's arguments are unboxed at every call: a full-size token's ~2000
# arrays, each a MemInfo made and its Python object read (cold: ~0.4 ms for 8 layers' 56 calls
# after a 400 MB sweep, this machine; ~70 us warm). Stored once in a buffer (`_fill`), in
# Numba's data layout with no MemInfo (so nothing in the kernels counts references to them:
# Numba's NRT_incref/decref skip a null one; the step keeps the arrays alive), they are read by
# the sequence's runner (`_runner`), whose one argument is the buffer's address. (A StructRef
# did the same with reference counts: its constructor for 8 layers' 56 calls took ~200 s to
# compile.)

def _storable(ty) -> bool:
    """Tuples of arrays and numbers (nested), which `_store` lays out and clears."""
    if isinstance(ty, types.BaseTuple):
        return all(_storable(t) for t in ty.types)
    return isinstance(ty, (types.Array, types.Number, types.Boolean))


def _clear_meminfos(builder, pointer, ty, path: list) -> None:
    """Null every array's MemInfo (field 0 of its struct) in the data at `pointer`."""
    i32 = ir.IntType(32)
    if isinstance(ty, types.BaseTuple):
        for i, t in enumerate(ty.types):
            _clear_meminfos(builder, pointer, t, path + [i])
    elif isinstance(ty, types.Array):
        field = builder.gep(pointer, [ir.Constant(i32, i) for i in [0] + path + [0]])
        builder.store(ir.Constant(field.type.pointee, None), field)


@intrinsic
def _store(typingctx, value, address):
    """value (a `_storable` tuple) into the buffer at `address`, in its data layout, with no
    MemInfo: borrowed, never counted."""
    if not _storable(value):
        return None

    def codegen(context, builder, sig, args):
        model = context.data_model_manager[value]
        pointer = builder.inttoptr(args[1], model.get_data_type().as_pointer())
        builder.store(model.as_data(builder, args[0]), pointer)
        _clear_meminfos(builder, pointer, value, [])
        return context.get_dummy_value()

    return types.none(value, types.int64), codegen


@kernel
def _fill(value, address):
    _store(value, address)


def _run_from(stored_ty):
    """An intrinsic `run(address)`: the calls of the (addresses, arguments) of type `stored_ty`
    stored at `address` by `_fill`."""
    addresses_ty, arguments_ty = stored_ty.types

    @intrinsic
    def run(typingctx, address):
        def codegen(context, builder, sig, args):
            model = context.data_model_manager[stored_ty]
            pointer = builder.inttoptr(args[0], model.get_data_type().as_pointer())
            stored = model.from_data(builder, builder.load(pointer))
            addresses, arguments = cgutils.unpack_tuple(builder, stored)
            _emit_calls(context, builder, cgutils.unpack_tuple(builder, addresses), arguments,
                        arguments_ty)
            return context.get_dummy_value()

        return types.none(types.int64), codegen

    return run


def _runner_body(address):
    run(address)


_runners: dict = {}


def _runner(stored_ty):
    """The kernel running sequences stored as `stored_ty` given their buffer's address: one per
    tuple of argument types, cached under a digest of it."""
    key = str(stored_ty)
    if key not in _runners:
        digest = hashlib.sha256(key.encode()).hexdigest()[:20]
        _runners[key] = kernel(_runner_body, variant=f"sequence-{digest}",
                               run=_run_from(stored_ty))
    return _runners[key]


class Joined:
    """A joined step's callable: its runner on its buffer, which it keeps with the arguments'
    arrays (the buffer borrows them)."""

    __slots__ = ("runner", "buffer", "arguments")

    def __init__(self, runner, buffer, arguments):
        self.runner, self.buffer, self.arguments = runner, buffer, arguments

    def __call__(self, address):
        self.runner(address)


def joined_step(label: str, addresses: tuple, arguments: tuple) -> tuple | None:
    """The step (label, Joined, (buffer address,)) running the kernels at `addresses` on
    `arguments` in turn; None where the arguments are not all arrays and numbers."""
    stored = (addresses, arguments)
    stored_ty = typeof(stored)
    if not _storable(stored_ty):
        return None
    context = cpu_target.target_context
    nbytes = context.get_abi_sizeof(context.data_model_manager[stored_ty].get_data_type())
    buffer = np.zeros(nbytes + 64, np.uint8)
    address = (buffer.ctypes.data + 63) // 64 * 64
    _fill(stored, address)
    return label, Joined(_runner(stored_ty), buffer, arguments), (address,)


def _takes(compiled: tuple, argtys: tuple) -> bool:
    """Code compiled for `compiled` takes arguments of `argtys` as they are: the same types, or
    read-only arrays where these are writable (the same data model: Numba's own dispatch enters
    such code for such arguments, jit/dispatch.py)."""
    return len(compiled) == len(argtys) and all(
        c == a or (isinstance(c, types.Array) and isinstance(a, types.Array) and not c.mutable
                   and a.copy(readonly=True) == c)
        for c, a in zip(compiled, argtys))


def callable_address(fn, args: tuple) -> int | None:
    """The address of the machine code that `fn(*args)` runs, where `fn` is a Numba dispatcher
    whose code for these arguments returns nothing; else None (call it as it is)."""
    if not isinstance(fn, Dispatcher):
        return None
    try:
        argtys = tuple(fn.typeof_pyval(a) for a in args)
    except (ValueError, TypeError):
        return None
    if not any(_takes(c, argtys) for c in fn.overloads):
        try:
            fn.compile(argtys)
        except Exception:  # noqa: BLE001  (typing errors: left to the call itself to raise)
            return None
    cres = fn.overloads.get(argtys) or next(
        (cres for c, cres in fn.overloads.items() if _takes(c, argtys)), None)
    if cres is None or cres.signature.return_type != types.none or cres.objectmode:
        return None
    address = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    return address or None


# A plan's mark between runs to join apart (decode's layers): each run one kernel per kind of
# layer, whatever the model's depth (a compile of ~10-30 s a kind, under load, then cached).
BREAK = ("|", None, ())


def without_breaks(steps: list) -> list:
    return [step for step in steps if step is not BREAK]


def join(steps: list, name=" + ".join) -> list:
    """Decode-plan steps (label, callable, args) with each run of two or more consecutive
    joinable kernels (`callable_address`) made one step (`joined_step`), labelled
    `name(their labels)`: the same calls in the same order, one dispatch."""
    out, run = [], []

    def flush():
        if len(run) >= 2:
            step = joined_step(name([step[0] for step, _ in run]),
                               tuple(address for _, address in run),
                               tuple(step[2] for step, _ in run))
            out.extend([step] if step is not None else [step for step, _ in run])
        else:
            out.extend(step for step, _ in run)
        run.clear()

    for step in steps:
        if step is BREAK:
            flush()
            continue
        address = callable_address(step[1], step[2])
        if address is None:
            flush()
            out.append(step)
        else:
            run.append((step, address))
    flush()
    return out
