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

from numba import types
from numba.core import cgutils
from numba.core.dispatcher import Dispatcher
from numba.extending import intrinsic

from fermijit.jit.cpu import kernel


@intrinsic
def _call_each(typingctx, addresses, arguments):
    """addresses: n int64; arguments: n tuples: calls address i with the items of tuple i
    (Numba's calling convention, no return value, the status ignored: kernels do not raise)."""
    if not (isinstance(addresses, types.BaseTuple) and isinstance(arguments, types.BaseTuple)
            and len(addresses) == len(arguments)
            and all(isinstance(t, types.BaseTuple) for t in arguments.types)):
        return None

    def codegen(context, builder, sig, args):
        call_conv = context.call_conv
        addrs = cgutils.unpack_tuple(builder, args[0])
        tuples = cgutils.unpack_tuple(builder, args[1])
        for address, items_ty, items in zip(addrs, arguments.types, tuples):
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
        return context.get_dummy_value()

    return types.none(addresses, arguments), codegen


@kernel
def run_each(addresses, arguments):
    """Kernel i of a sequence (its address, `callable_address`) on arguments[i], in turn."""
    _call_each(addresses, arguments)


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
    joinable kernels (`callable_address`) made one step calling `run_each`, labelled
    `name(their labels)`: the same calls in the same order, one dispatch."""
    out, run = [], []

    def flush():
        if len(run) >= 2:
            out.append((name([step[0] for step, _ in run]), run_each,
                        (tuple(address for _, address in run), tuple(step[2] for step, _ in run))))
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
