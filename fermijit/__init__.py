"""fermijit: Qwen3.6-35B-A3B in 4 bits on a Westmere CPU and a Fermi GPU, in pure Python."""

__version__ = "0.1.0"


class FermijitError(Exception):
    """A user-facing failure: the message is one line, shown without a traceback."""


def _take_back_cpus() -> None:
    """In a child of a process whose kernel threads are bound to cores (`--pin-threads`): the
    child starts bound to the one core of the parent's calling thread; it takes back the CPUs the
    parent could run on (jit/cpu.py CPUS_ENV), before Numba counts them for its threads."""
    import os

    cpus = os.environ.get("FERMIJIT_CPUS")
    if cpus:
        try:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        except (OSError, ValueError):
            pass  # a narrower cgroup than the parent's: stay where this process was put


_take_back_cpus()
