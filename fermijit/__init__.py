"""fermijit: Qwen3.6-35B-A3B in 4 bits on a Westmere CPU and a Fermi GPU, in pure Python."""

__version__ = "0.1.0"


class FermijitError(Exception):
    """A user-facing failure: the message is one line, shown without a traceback."""
