"""NUMA placement of the memory-mapped weights: `--numa interleave|local|off` (issue 9 item 5).

Decode reads every weight once per token from all threads, so on a machine of several nodes the
weights' pages are best spread over every node's memory controller (interleave); `local` keeps
them on the node that faults them in; `off` leaves the kernel's default. Default: interleave
where there are several nodes, else off.

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

CHOICES = ("interleave", "local", "off")
MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE, MPOL_LOCAL = range(5)
MPOL_F_ADDR = 1 << 1
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
    if policy == "interleave":
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
    for a in regions:
        if a.nbytes == 0:
            continue
        start = a.ctypes.data // PAGE * PAGE
        length = a.ctypes.data + a.nbytes - start
        _call(0, ctypes.c_void_p(start), ctypes.c_ulong(length), ctypes.c_long(mode), mask,
              maxnode if mask is not None else ctypes.c_ulong(0), ctypes.c_ulong(0))
    _call(1, ctypes.c_long(mode), mask, maxnode if mask is not None else ctypes.c_ulong(0))
    return policy


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
