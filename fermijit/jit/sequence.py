"""Several compiled kernels called in turn from one dispatch: decode's plan runs a layer's
kernels (ops.residual_step, the GEMVs, ops.gdn_step, ops.moe...) as one call.

Why: a Numba dispatch costs ~1-3 us with its code and the arrays' Python objects in cache, but
decode streams ~1 GB of weights a token through the caches, and a dispatch after a kernel found
them cold: 15-25 us measured here (an empty kernel given a layer step's arguments after a 400 MB
sweep), ~5-15 us between a token's kernels. A full-size token made ~250 such calls, ~1.5-3 ms
at every thread count (the "serial" and "Python" columns of a 16-thread profile).

How: each kernel's own machine code (the code its dispatcher runs, compiled alone or loaded from
the cache) is called through its address, with Numba's calling convention, from a small kernel
taking (addresses, arguments): not linked and optimised again inside a caller (under fast-math a
re-optimised copy may round differently: jit/dispatch.py), so every call gives the bits of the
call through its own dispatcher. The addresses are arguments, not constants, so the caller is
one cached kernel per tuple of argument types.

Only kernels that return nothing, compiled for the arguments' types (or read-only arrays where
they are writable), are joined (`callable_address`); anything else stays a call of its own.
"""

from __future__ import annotations

import hashlib

from numba import types
from numba.core import cgutils
from numba.core.dispatcher import Dispatcher
from numba.experimental import structref
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


def _is_sequence(addresses, arguments) -> bool:
    return (isinstance(addresses, types.BaseTuple) and isinstance(arguments, types.BaseTuple)
            and len(addresses) == len(arguments)
            and all(isinstance(t, types.BaseTuple) for t in arguments.types))


@intrinsic
def _call_each(typingctx, addresses, arguments):
    """addresses: n int64; arguments: n tuples: calls address i with the items of tuple i."""
    if not _is_sequence(addresses, arguments):
        return None

    def codegen(context, builder, sig, args):
        _emit_calls(context, builder, cgutils.unpack_tuple(builder, args[0]), args[1], arguments)
        return context.get_dummy_value()

    return types.none(addresses, arguments), codegen


@kernel
def run_each(addresses, arguments):
    """Kernel i of a sequence (its address, `callable_address`) on arguments[i], in turn."""
    _call_each(addresses, arguments)


# --- a sequence held in native memory ------------------------------------------------------------
# Given as a tuple, a sequence's arguments are unboxed at every call: a full-size token's ~2000
# arrays, each a MemInfo made and its Python object read (cold: ~0.4 ms for 8 layers' 56 calls
# after a 400 MB sweep, this machine; ~70 us warm). Stored once in a struct (`Sequence`, made by
# `_make`), they are read by its runner (`_runner`) from the struct's memory, whose address is
# the runner's one argument.

@structref.register
class _SequenceType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class Sequence(structref.StructRefProxy):
    """(addresses, arguments) in native memory: what a runner (`_runner`) calls."""


structref.define_proxy(Sequence, _SequenceType, ["addresses", "arguments"])


@kernel
def _make(addresses, arguments):
    return Sequence(addresses, arguments)


def _run_from(payload_ty):
    """An intrinsic `run(data)`: the calls of the Sequence payload of type `payload_ty` at
    address `data` (int64), read in place (borrowed: the Sequence's owner keeps it alive)."""
    addresses_ty = payload_ty.field_dict["addresses"]
    arguments_ty = payload_ty.field_dict["arguments"]

    @intrinsic
    def run(typingctx, data):
        def codegen(context, builder, sig, args):
            data_ty = context.data_model_manager[payload_ty].get_data_type()
            pointer = builder.inttoptr(args[0], data_ty.as_pointer())
            payload = context.make_data_helper(builder, payload_ty, ref=pointer)
            _emit_calls(context, builder, cgutils.unpack_tuple(builder, payload.addresses),
                        payload.arguments, arguments_ty)
            return context.get_dummy_value()

        return types.none(types.int64), codegen

    assert isinstance(addresses_ty, types.BaseTuple)
    return run


def _runner_body(data):
    run(data)


_runners: dict = {}


def _runner(sequence_ty):
    """The kernel running Sequences of type `sequence_ty` given their payload's address: one
    per tuple of argument types, cached under a digest of it."""
    key = str(sequence_ty)
    if key not in _runners:
        payload_ty = sequence_ty.get_data_type()
        digest = hashlib.sha256(key.encode()).hexdigest()[:20]
        _runners[key] = kernel(_runner_body, variant=f"sequence-{digest}",
                               run=_run_from(payload_ty))
    return _runners[key]


class Joined:
    """A joined step's callable: `runner(data)` on its Sequence's payload, which it keeps."""

    __slots__ = ("runner", "sequence")

    def __init__(self, runner, sequence):
        self.runner, self.sequence = runner, sequence

    def __call__(self, data):
        self.runner(data)


def joined_step(label: str, addresses: tuple, arguments: tuple) -> tuple:
    """The step (label, Joined, (payload address,)) running kernels at `addresses` on
    `arguments` in turn."""
    sequence = _make(addresses, arguments)
    return label, Joined(_runner(sequence._type), sequence), (sequence._meminfo.data,)


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


def join(steps: list, name=" + ".join) -> list:
    """Decode-plan steps (label, callable, args) with each run of two or more consecutive
    joinable kernels (`callable_address`) made one step (`joined_step`), labelled
    `name(their labels)`: the same calls in the same order, one dispatch."""
    out, run = [], []

    def flush():
        if len(run) >= 2:
            out.append(joined_step(name([step[0] for step, _ in run]),
                                   tuple(address for _, address in run),
                                   tuple(step[2] for step, _ in run)))
        else:
            out.extend(step for step, _ in run)
        run.clear()

    for step in steps:
        address = callable_address(step[1], step[2])
        if address is None:
            flush()
            out.append(step)
        else:
            run.append((step, address))
    flush()
    return out
