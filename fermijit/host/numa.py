"""NUMA placement of the memory-mapped weights: `--numa interleave|rows|local|off`.

Decode reads every weight once per token from all threads, so on a machine of several nodes the
weights' pages are best spread over every node's memory controller (interleave); `local` keeps
them on the node that faults them in; `off` leaves the kernel's default. Default: interleave
where there are several nodes, else off. `rows` interleaves too, then moves each thread's rows of
the matrices decode splits the same way every token (the dense projections, the LM head, the
fp32 router and gates: thread t of n takes rows [t·R/n, (t+1)·R/n)) to the node of the core that
thread is bound to (`--pin-threads`), so those reads stay on their node; the routed experts,
whose split follows the token's routing, stay interleaved.

Two calls through ctypes, because a page-cache page of a regular file is allocated by the policy
of the task that faults it, not by the mapping's (mm/filemap.c): `mbind` sets the policy of the
weight mapping itself (and of any private page made from it), `set_mempolicy` the task's, for the
file pages the first decode reads in. `get_mempolicy` reads either back (the test).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
from pathlib import Path

import numpy as np

from fermijit import FermijitError

CHOICES = ("interleave", "rows", "local", "off")
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE, MPOL_LOCAL = range(5)
MPOL_F_ADDR = 1 << 1
MPOL_MF_MOVE = 1 << 1  # mbind: move the range's pages already placed elsewhere
# (mbind, set_mempolicy, get_mempolicy) syscall numbers
SYSCALLS = {"x86_64": (237, 238, 239), "aarch64": (235, 237, 236)}
MASK_WORDS = 16  # nodemask of 1024 bits: more nodes than any machine here has
PAGE = os.sysconf("SC_PAGE_SIZE")


def online_nodes() -> list[int]:
    """The NUMA nodes with memory online (/sys/devices/system/node/online, e.g. "0-1")."""
    try:
        text = Path("/sys/devices/system/node/online").read_text().strip()
    except OSError:
        return [0]
    nodes = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        nodes += range(int(lo), int(hi or lo) + 1)
    return nodes


def default_policy() -> str:
    return "interleave" if len(online_nodes()) > 1 else "off"


@functools.lru_cache(maxsize=None)
def _syscall():
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None or not os.path.exists("/sys/devices/system/node"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall, numbers


def _mask(nodes) -> ctypes.Array:
    mask = (ctypes.c_ulong * MASK_WORDS)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    return mask


def _call(which: int, *args) -> None:
    fn, numbers = _syscall()
    if fn(ctypes.c_long(numbers[which]), *args) != 0:
        err = ctypes.get_errno()
        raise FermijitError(f"NUMA policy: {('mbind', 'set_mempolicy', 'get_mempolicy')[which]} "
                            f"failed: {os.strerror(err)}")


def _mode_and_mask(policy: str) -> tuple[int, ctypes.Array | None]:
    if policy in ("interleave", "rows"):
        return MPOL_INTERLEAVE, _mask(online_nodes())
    if policy == "local":
        return MPOL_LOCAL, None
    return MPOL_DEFAULT, None


_selected: str | None = None


def select(policy: str | None) -> None:
    """The process's policy for the weights loaded from now on (`--numa`); None: the default."""
    global _selected
    if policy is not None and policy not in CHOICES:
        raise FermijitError(f"--numa must be one of {', '.join(CHOICES)}, got {policy!r}")
    _selected = policy


def apply(regions: list[np.ndarray], policy: str | None = None) -> str:
    """Set `policy` (None: the selected one, else the default) for the task and for the pages of
    each array's mapping in `regions`; returns the policy applied. "off" changes nothing."""
    return apply_to([(a.ctypes.data, a.nbytes) for a in regions], policy)


def apply_to(ranges: list[tuple[int, int]], policy: str | None = None) -> str:
    """`apply` to (address, nbytes) ranges (serve's registering threads at exec, before numpy:
    fermijit/jit/gpu_early.py)."""
    policy = policy or _selected or default_policy()
    if policy not in CHOICES:
        raise FermijitError(f"--numa must be one of {', '.join(CHOICES)}, got {policy!r}")
    if policy == "off":
        return policy
    if _syscall() is None:
        raise FermijitError(f"--numa {policy}: no NUMA system calls on this platform "
                            f"({platform.machine()})")
    mode, mask = _mode_and_mask(policy)
    maxnode = ctypes.c_ulong(MASK_WORDS * 64 + 1)  # the kernel reads maxnode - 1 bits
    for address, nbytes in ranges:
        if nbytes == 0:
            continue
        start = address // PAGE * PAGE
        length = address + nbytes - start
        _call(0, ctypes.c_void_p(start), ctypes.c_ulong(length), ctypes.c_long(mode), mask,
              maxnode if mask is not None else ctypes.c_ulong(0), ctypes.c_ulong(0))
    _call(1, ctypes.c_long(mode), mask, maxnode if mask is not None else ctypes.c_ulong(0))
    return policy


def selected() -> str:
    """The policy the weights loaded from now on get (`select`, else the default)."""
    return _selected or default_policy()


def cpu_nodes() -> dict[int, int]:
    """CPU number -> its node (/sys/devices/system/node/node*/cpulist); every CPU on node 0
    where the machine says nothing."""
    out = {}
    for node in online_nodes():
        try:
            text = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
        except OSError:
            continue
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            out.update((cpu, node) for cpu in range(int(lo), int(hi or lo) + 1))
    return out or {cpu: 0 for cpu in os.sched_getaffinity(0)}


def physical_cores() -> list[list[int]]:
    """This process's cores in libgomp's `cores` places order: each core's CPUs (SMT siblings
    together), cores ordered by their first CPU."""
    cores = {}
    for n in sorted(os.sched_getaffinity(0)):
        try:
            key = Path(f"/sys/devices/system/cpu/cpu{n}/topology/thread_siblings_list"
                       ).read_text().strip()
        except OSError:
            key = str(n)
        cores.setdefault(key, []).append(n)
    return sorted(cores.values(), key=min)


def team_nodes(n_threads: int, cores: list[list[int]] | None = None,
               node_of: dict[int, int] | None = None) -> list[int]:
    """The node each thread of a team of `n_threads` runs on when bound (`--pin-threads`: thread
    t on the t-th core, jit/cpu.py PIN_ENV); `cores` and `node_of` stand for this machine's
    topology (tests give others)."""
    cores = cores if cores is not None else physical_cores()
    node_of = node_of if node_of is not None else cpu_nodes()
    return [node_of.get(min(cores[t % len(cores)]), 0) for t in range(n_threads)]


def row_ranges(address: int, n_rows: int, row_bytes: int, nodes: list[int],
               page: int = PAGE) -> list[tuple[int, int, int]]:
    """(start, length, node): the whole pages inside each thread's rows [t·R/n, (t+1)·R/n) of a
    matrix of `n_rows` rows of `row_bytes` at `address` (thread t of n = len(nodes) on
    nodes[t]), neighbours on one node merged. Pages a boundary between threads cuts stay as
    they are."""
    n = len(nodes)
    out: list[list[int]] = []
    for t, node in enumerate(nodes):
        lo = address + t * n_rows // n * row_bytes
        hi = address + (t + 1) * n_rows // n * row_bytes
        lo, hi = -(-lo // page) * page, hi // page * page
        if hi <= lo:
            continue
        if out and out[-1][2] == node and out[-1][0] + out[-1][1] == lo:
            out[-1][1] += hi - lo
        else:
            out.append([lo, hi - lo, node])
    return [tuple(r) for r in out]


def place_rows(matrices: list[np.ndarray], nodes: list[int]) -> int:
    """`rows` placement: each matrix's threads' rows (`row_ranges`) preferred on their threads'
    nodes, pages already elsewhere moved; returns the bytes placed."""
    if _syscall() is None:
        raise FermijitError(f"--numa rows: no NUMA system calls on this platform "
                            f"({platform.machine()})")
    maxnode = ctypes.c_ulong(MASK_WORDS * 64 + 1)
    placed = 0
    for a in matrices:
        for start, length, node in row_ranges(a.ctypes.data, a.shape[0], a.strides[0], nodes):
            _call(0, ctypes.c_void_p(start), ctypes.c_ulong(length),
                  ctypes.c_long(MPOL_PREFERRED), _mask([node]), maxnode,
                  ctypes.c_ulong(MPOL_MF_MOVE))
            placed += length
    return placed


def policy_of(address: int | None = None) -> tuple[int, list[int]]:
    """(mode, nodes) of the mapping holding `address`, or of the task when None."""
    if _syscall() is None:
        raise FermijitError("no NUMA system calls on this platform")
    mode = ctypes.c_int(-1)
    mask = _mask([])
    flags = 0 if address is None else MPOL_F_ADDR
    _call(2, ctypes.byref(mode), mask, ctypes.c_ulong(MASK_WORDS * 64),
          ctypes.c_void_p(address or 0), ctypes.c_ulong(flags))
    nodes = [n for n in range(MASK_WORDS * 64) if mask[n // 64] >> (n % 64) & 1]
    return mode.value, nodes
