"""The snapshot prefix cache (DESIGN.md, Snapshot prefix cache): resume a prompt from the
longest cached prefix of it instead of prefilling it all.

A KV cache can be cut at any prefix; a Gated DeltaNet state exists only at the positions where it
was saved. So the cache is a radix tree over token ids whose edges carry the KV rows of their
positions (every attention layer's k and v for tokens [start, end): stored once, shared by every
snapshot below) and whose nodes may carry a snapshot: every GDN layer's conv and recurrent state
at the node's position, and the logits after it when the snapshot ends a prompt or a generation
(a repeated prompt then needs no forward at all). Restoring a snapshot at position p gathers the
KV rows [0, p) along its path and copies the GDN states into a fresh `State`.

Bounded by `mem_bytes`: eviction is GreedyDual-Size (Cao & Irani 1997), which keeps what saves
the most recompute per byte and is LRU when all are alike: a snapshot's credit, set when it is
made or hit, is the clock plus the tokens it saves (its position less its nearest snapshotted
ancestor's) per MiB that evicting it frees; the lowest credit goes first and becomes the clock.
With `directory` (fermijit/cache/snapshot_dir.py) every snapshot is also written to disk and a disk
snapshot deeper than memory's best is loaded on lookup.

One cache serves one model: its fingerprint (`model_fingerprint`) names the on-disk entries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model.state import GdnState, KvCache, State

# Prefill passes end and snapshots are taken every this many positions. Measured by
# `python -m fermijit bench cache` (see notes/snapshot-cache.md): on the default model a
# snapshot costs about as much as prefilling a couple of tokens, while passes shorter than 256
# slow the batched prefill; a branch then recomputes at most 255 tokens, 128 on average.
SNAPSHOT_EVERY = 256
# --cache-mem default: this share of the machine's RAM (the weights are memory-mapped beside it).
MEM_SHARE = 1 / 8
MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """What the CLI's cache flags ask for; `mem_bytes` None is MEM_SHARE of the RAM."""

    is_enabled: bool = True
    mem_bytes: int | None = None
    directory: Path | None = None
    snapshot_every: int = SNAPSHOT_EVERY
    key: bytes | None = None     # --cache-key: snapshots on disk signed and checked with it


@dataclasses.dataclass
class Snapshot:
    gdn: list[GdnState | None]   # per layer; None at attention layers
    logits: np.ndarray | None    # [V] after the last token, where known
    credit: float = 0.0          # GreedyDual-Size: evicted lowest first
    hidden: np.ndarray | None = None  # State.hidden: with the MTP layer (model/mtp.py)

    @property
    def nbytes(self) -> int:
        return (sum(s.conv.nbytes + s.recurrent.nbytes for s in self.gdn if s is not None)
                + (0 if self.logits is None else self.logits.nbytes)
                + (0 if self.hidden is None else self.hidden.nbytes))


class Node:
    """An edge of the radix tree: tokens [start, end) and their KV rows; a snapshot at `end`."""

    def __init__(self, parent: Node | None, start: int, tokens: np.ndarray,
                 kv: list[KvCache]):
        self.parent, self.start, self.tokens, self.kv = parent, start, tokens, kv
        self.children: dict[int, Node] = {}
        self.snapshot: Snapshot | None = None

    @property
    def end(self) -> int:
        return self.start + self.tokens.size

    @property
    def kv_nbytes(self) -> int:
        return sum(c.nbytes for c in self.kv)


def model_fingerprint(model_dir: str | Path, kv=None, with_mtp: bool = False,
                      hash_data: bool = False) -> str:
    """sha256 naming a model's weights: a fermijit model's manifest (which holds a sha256 per
    tensor) and weight-file headers, or an HF checkpoint's source fingerprint (run in fp32:
    other numbers, another key) and, with `hash_data` (snapshots kept on disk), the sha256 of
    its weight files' bytes: new weights of the same shapes keep the headers; the KV cache's
    kind `kv` (model.state.KvKind, default Q8_0) but for fp32, whose key is as before Q8_0
    caches were: its snapshots still load, Q8_0 runs never see them; `with_mtp`: of its states
    with the MTP layer (speculative decoding: other arrays, another key)."""
    from fermijit.model import convert
    from fermijit.model.data_hash import file_sha256
    from fermijit.model.safetensors_io import Checkpoint
    from fermijit.model.state import DEFAULT_KV, KvKind

    model_dir = Path(model_dir)
    h = hashlib.sha256(b"fermijit snapshot cache 1\n")
    ckpt = Checkpoint(model_dir)
    if convert.is_fermijit_model(model_dir):
        h.update(b"fermijit\n" + (model_dir / convert.MANIFEST).read_bytes())
    else:
        h.update(b"hf fp32\n")
        if hash_data:
            for f in ckpt.files:
                h.update(f"{f.path.name}:{file_sha256(f.path)}\n".encode())
    h.update(convert.source_fingerprint(model_dir, ckpt).encode())
    kv = kv or DEFAULT_KV
    if kv is not KvKind.F32:
        h.update(f"kv {kv.value}\n".encode())
    if with_mtp:
        h.update(b"with the MTP layer\n")
    return h.hexdigest()


def default_mem_bytes() -> int:
    return int(MEM_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def common_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading elements a and b share."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _if_whole(logits: np.ndarray | None, position: int, prompt: np.ndarray) -> np.ndarray | None:
    """A copy of the logits after `position` tokens if that is all of `prompt` (else a token is
    left to prefill, and they are not the prompt's)."""
    return None if logits is None or position < prompt.size else logits.copy()


class PrefixCache:
    """Snapshots of one model's state keyed by exact token prefixes, in memory (and on disk)."""

    def __init__(self, fingerprint: str, mem_bytes: int | None = None,
                 directory: str | Path | None = None, snapshot_every: int = SNAPSHOT_EVERY,
                 check=None, warn=None, key: bytes | None = None):
        if snapshot_every < 1:
            raise FermijitError(f"--snapshot-every must be at least 1, got {snapshot_every}")
        self.fingerprint = fingerprint
        self.mem_bytes = default_mem_bytes() if mem_bytes is None else mem_bytes
        self.snapshot_every = snapshot_every
        self.root = Node(None, 0, np.empty(0, np.int32), [])
        self.nbytes = 0              # KV rows and snapshots held
        self.clock = 0.0             # GreedyDual-Size's inflation value L
        self.snapshots: set[Node] = set()
        self.disk = None
        if directory is not None:
            from fermijit.cache.snapshot_dir import SnapshotDir
            self.disk = SnapshotDir(Path(directory), fingerprint, check=check,
                                    warn=warn or (lambda line: print(line, file=sys.stderr)),
                                    key=key)

    @property
    def n_snapshots(self) -> int:
        return len(self.snapshots)

    # --- lookup and restore ---------------------------------------------------------------------

    def restore(self, prompt: np.ndarray, context: int) -> tuple[State | None, np.ndarray | None]:
        """The state after the longest cached prefix of `prompt` (None when none is), its KV
        caches allocated to `context`, and the logits after it when the prefix is the whole
        prompt (else None: at least one token is left to prefill)."""
        prompt = np.asarray(prompt, np.int32)
        node, path = self._best(prompt)
        position = 0 if node is None else node.end
        if self.disk is not None:
            loaded = self.disk.best_load(prompt, position)
            if loaded is not None:
                state, logits = loaded
                self.add(prompt[:state.position], state, logits, to_disk=False)
                node, path = self._best(prompt)
                if node is None or node.end < state.position:  # evicted at once: too big
                    return state.copy(context), _if_whole(logits, state.position, prompt)
        if node is None:
            return None, None
        self._credit(node)
        return (self._state(node, path, context),
                _if_whole(node.snapshot.logits, node.end, prompt))

    def _best(self, prompt: np.ndarray) -> tuple[Node | None, list[Node]]:
        """The deepest snapshotted node on `prompt`'s path that leaves a token to prefill or
        has the logits of the whole prompt, and the path to it (root excluded)."""
        node, pos, path, best = self.root, 0, [], (None, [])
        while pos < prompt.size:
            child = node.children.get(int(prompt[pos]))
            if child is None or common_length(child.tokens, prompt[pos:]) < child.tokens.size:
                break
            node, pos = child, child.end
            path.append(node)
            s = node.snapshot
            if s is not None and (pos < prompt.size or s.logits is not None):
                best = (node, list(path))
        return best

    def _state(self, node: Node, path: list[Node], context: int) -> State:
        position, kv_rows = node.end, [iter(n.kv) for n in path]
        layers = []
        for s in node.snapshot.gdn:
            if s is not None:
                layers.append(GdnState(s.conv.copy(), s.recurrent.copy()))
                continue
            pieces = [next(rows) for rows in kv_rows]
            hkv, _, d = pieces[0].k.shape
            cache = KvCache.zeros(pieces[0].kind, hkv, context, d)
            for n, piece in zip(path, pieces):
                cache.put(n.start, piece)
            layers.append(cache)
        hidden = node.snapshot.hidden
        return State(position, layers, hidden=None if hidden is None else hidden.copy())

    # --- adding -------------------------------------------------------------------------------

    def add(self, tokens: np.ndarray, state: State, logits: np.ndarray | None = None,
            to_disk: bool = True) -> None:
        """Snapshot `state`, which has seen exactly `tokens`; `logits` the output after them."""
        tokens = np.asarray(tokens, np.int32)
        if tokens.size != state.position or tokens.size == 0:
            raise FermijitError(f"snapshot: {tokens.size} tokens for a state at position "
                                f"{state.position}")
        if state.hidden is not None and state.hidden.shape[0] != 1:
            raise FermijitError(f"snapshot: the MTP layer waits on {state.hidden.shape[0]} "
                                f"hidden states (1 at rest: Speculator.settle)")
        node = self._insert_path(tokens, state)
        gdn = [GdnState(s.conv.copy(), s.recurrent.copy()) if isinstance(s, GdnState) else None
               for s in state.layers]
        logits = None if logits is None else np.array(logits, np.float32)
        old = node.snapshot
        if old is not None:
            self.nbytes -= old.nbytes
            logits = old.logits if logits is None else logits
        node.snapshot = Snapshot(gdn, logits,
                                 hidden=None if state.hidden is None else state.hidden.copy())
        self.nbytes += node.snapshot.nbytes
        self.snapshots.add(node)
        self._credit(node)
        if to_disk and self.disk is not None:
            self.disk.write(tokens, state, logits)
        self._evict()

    def _insert_path(self, tokens: np.ndarray, state: State) -> Node:
        """The node ending at tokens.size on their path, made (KV rows copied) where missing."""
        node, pos = self.root, 0
        while pos < tokens.size:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                rows = [s.rows(pos, tokens.size).copy()
                        for s in self._kv_layers(state, tokens.size)]
                child = Node(node, pos, tokens[pos:].copy(), rows)
                node.children[int(tokens[pos])] = child
                self.nbytes += child.kv_nbytes
                return child
            m = common_length(child.tokens, tokens[pos:])
            if m < child.tokens.size:
                child = self._split(child, m)
            node, pos = child, child.end
            if pos < tokens.size and state.hidden is not None:
                self._refresh_mtp_row(node, state)
        return node

    def _refresh_mtp_row(self, node: Node, state: State) -> None:
        """The MTP layer's KV row of node's last position, from a state past it: its cache lags
        the model by one position (model/state.py), so a snapshot's last row of it was not yet
        computed, and an edge ending at one holds it stale until a longer state passes."""
        c, s = node.kv[-1], state.layers[-1]
        c.k[:, -1] = s.k[:, node.end - 1]
        c.v[:, -1] = s.v[:, node.end - 1]

    @staticmethod
    def _kv_layers(state: State, position: int) -> list[KvCache]:
        return [s.rows(0, position) for s in state.layers if isinstance(s, KvCache)]

    def _split(self, node: Node, m: int) -> Node:
        """Cut `node`'s edge after m tokens; returns the new upper part."""
        upper = Node(node.parent, node.start, node.tokens[:m].copy(),
                     [c.rows(0, m).copy() for c in node.kv])
        node.parent.children[int(node.tokens[0])] = upper
        node.parent, node.start = upper, node.start + m
        node.tokens = node.tokens[m:].copy()
        node.kv = [c.rows(m, c.context).copy() for c in node.kv]
        upper.children[int(node.tokens[0])] = node
        return upper

    # --- eviction -----------------------------------------------------------------------------

    def _credit(self, node: Node) -> None:
        """GreedyDual-Size credit on a make or a hit: the clock plus tokens saved per MiB freed."""
        ancestor = node.parent
        while ancestor is not self.root and ancestor.snapshot is None:
            ancestor = ancestor.parent
        saved = node.end - ancestor.end
        node.snapshot.credit = self.clock + saved / (self._freed_by(node) / MIB)

    def _freed_by(self, node: Node) -> int:
        """Bytes that evicting node's snapshot frees: it, and the KV rows only it needs (a leaf's
        edge and the ancestor edges that lead to it alone)."""
        nbytes = node.snapshot.nbytes
        if not node.children:
            while node is not self.root:
                nbytes += node.kv_nbytes
                node = node.parent
                if node.snapshot is not None or len(node.children) != 1:
                    break
        return max(nbytes, 1)

    def _evict(self) -> None:
        while self.nbytes > self.mem_bytes and self.snapshots:
            node = min(self.snapshots, key=lambda n: n.snapshot.credit)
            self.clock = node.snapshot.credit
            self.drop(node)

    def drop(self, node: Node) -> None:
        """Remove node's snapshot, and the KV rows no other snapshot needs."""
        self.nbytes -= node.snapshot.nbytes
        node.snapshot = None
        self.snapshots.discard(node)
        while node is not self.root and node.snapshot is None and not node.children:
            del node.parent.children[int(node.tokens[0])]
            self.nbytes -= node.kv_nbytes
            node = node.parent
