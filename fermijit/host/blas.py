"""numpy's BLAS at one thread while the CPU forward runs.

The forward's few fp32 products (router logits, the GDN gates: model/forward.py) went through
numpy's OpenBLAS, whose worker threads busy-wait after each call for the next one (they are
ops/fp32_rows.py's kernel now; this keeps any numpy product a forward still makes out of the
kernels' way). Between those
calls the Numba kernels run on their own OpenMP team of the same size, so on a machine with as
many cores as threads the spinning workers and the team take turns on the cores: a 512-token
prefill of the default model on 2 threads ran at 1450-2070 tok/s with OpenBLAS at 2 threads and
4690-4970 with it at 1 (1 thread: 3940-4370; 2 cores, load 3.2-3.4, same run, alternating).
The products are small next to the W4A8 GEMMs, so one BLAS thread costs nothing measurable.

OpenBLAS is reached through ctypes on the library numpy loaded (found in /proc/self/maps); where
there is none (another BLAS, or no /proc), `single_threaded` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re

# The thread-count entry points, as the OpenBLAS builds numpy ships spell them (scipy-openblas
# prefixes and suffixes its symbols; a system OpenBLAS does not).
_PREFIXES = ("scipy_openblas_", "openblas_")
_SUFFIXES = ("64_", "")


@functools.lru_cache(maxsize=None)
def _openblas():
    """(set_num_threads, get_num_threads) of the loaded OpenBLAS, or None."""
    import numpy  # noqa: F401  (loads the library)

    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            paths = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", f.read())))
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same handle, nothing initialised again
        except OSError:
            continue
        for prefix in _PREFIXES:
            for suffix in _SUFFIXES:
                setter = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
                getter = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
                if setter is not None and getter is not None:
                    setter.argtypes, setter.restype = [ctypes.c_int], None
                    getter.argtypes, getter.restype = [], ctypes.c_int
                    return setter, getter
    return None


def threads() -> int | None:
    """OpenBLAS's thread count now, or None without OpenBLAS."""
    lib = _openblas()
    return None if lib is None else lib[1]()


@contextlib.contextmanager
def single_threaded():
    """OpenBLAS at one thread inside the block, its count before restored after."""
    lib = _openblas()
    before = None if lib is None else lib[1]()
    if before is None or before == 1:
        yield
        return
    lib[0](1)
    try:
        yield
    finally:
        lib[0](before)
