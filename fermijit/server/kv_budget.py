"""The server's KV memory budget (`serve --kv-mem`): requests are admitted while
the states of the running sequences fit it, so a burst of long requests is answered with an error
instead of growing the caches until the OOM killer ends the server.

A sequence's state holds its KV caches for prompt + max_tokens positions and its GDN states
(model.state_nbytes). Its caches take memory only as its positions are used (model/state.py), but
a sequence admitted may use them all, so each counts whole. A request whose state alone exceeds
the budget can never run: a 400. One that does not fit beside the running sequences: a 503 (its
client retries once some have ended).
"""

from __future__ import annotations

from collections.abc import Iterable

from fermijit import FermijitError
from fermijit.model.state import available_nbytes
from fermijit.server.protocol import ApiError

# --kv-mem's default: this share of the memory available once the model is loaded and warm.
DEFAULT_SHARE = 0.5
MIB = 2 ** 20


def default_nbytes() -> int:
    return int(DEFAULT_SHARE * available_nbytes())


def budget_of(kv_mem: int | None) -> int:
    """The budget --kv-mem sets (None: `default_nbytes`)."""
    return default_nbytes() if kv_mem is None else kv_mem


def admit(model, n_positions: int, running: Iterable[int], budget: int,
          mtp: bool = False) -> int:
    """The bytes a sequence of `n_positions` positions (prompt + max_tokens) holds, if it fits
    `budget` beside running sequences of `running` positions each; else ApiError 400 / 503.
    `mtp`: the states hold the MTP layer's cache too (speculative decoding)."""
    need = model.state_nbytes(n_positions, mtp)
    if need > budget:
        raise ApiError(400, f"this request's {n_positions} positions (prompt + max_tokens) need "
                            f"{mib(need)} of KV cache and state, more than the server's "
                            f"--kv-mem of {mib(budget)}: shorten the prompt or max_tokens",
                       "max_tokens", "kv_memory_exceeded")
    running = list(running)
    held = sum(model.state_nbytes(n, mtp) for n in running)
    if held + need > budget:
        raise ApiError(503, f"the server's KV memory is in use ({mib(held)} of {mib(budget)} "
                            f"--kv-mem, by {len(running)} running requests; this one needs "
                            f"{mib(need)}): retry later", code="kv_memory_full",
                       kind="server_error")
    return need


def mib(nbytes: int) -> str:
    """MiB to a tenth: in whole MiB, "need 2 MiB, more than the --kv-mem of 2 MiB" (2.5 of 2.0,
    a soak's small --kv-mem)."""
    return f"{nbytes / MIB:.1f} MiB"


def check_batch(model, max_batch: int, budget: int) -> None:
    """FermijitError where `max_batch` of the shortest requests (one prompt token, one to
    generate) cannot fit `budget` together: such a batch could never fill, and the start makes
    its warm-up's states and the GPU's state pool for that many (--max-batch 100000 on the
    embedded model: 1.7 GB and over a minute with no request served; at full size, the OOM
    killer)."""
    need = model.state_nbytes(2)
    if max_batch * need > budget:
        raise FermijitError(f"--max-batch {max_batch}: that many requests hold at least "
                            f"{max_batch * need / MIB:.0f} MiB of KV cache and state, more than "
                            f"--kv-mem's {budget / MIB:.0f} MiB (which holds {budget // need} "
                            f"such requests): lower --max-batch or raise --kv-mem")
