"""The snapshot prefix cache on disk (`--cache-dir DIR`, issue 13 item 3): snapshots that survive
the process, shared by every process reading and writing one directory.

One file per snapshot, `DIR/<fingerprint[:16]>/<sha256(fingerprint, tokens)[:40]>.snap`, never
changed once written: written to a temporary name in the same directory, then renamed over
(atomic), so a reader sees a whole file or none; two processes writing one name write the same
snapshot, and either copy serves. A file holds the KV rows since its parent (the deepest
snapshot on disk that is a prefix of it, named in its header: rows are stored once along a
sequence, as in memory) and every GDN layer's conv and recurrent state, plus the logits after its
last token where known. A state with the MTP layer (model/state.py) also keeps its waiting hidden
state, and its KV rows start one row before its parent's end (`kv_from`): the parent's last row of
the MTP layer's cache, which lags the model by one position, was not computed when it was written.

    b"FJSNAP1\\n" | header length (u64 LE) | header (JSON) | kv section | state section

The header names the model's fingerprint, the tokens, the parent, the arrays of each section and
each section's CRC-32. Headers are read when the directory is scanned (at each lookup, so other
processes' files are seen); the arrays only when a snapshot is used (lazily), and only the KV
section of its ancestors. A corrupt, truncated or foreign-model file, or one whose parent is
missing, is skipped with one warning line, never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model.state import GdnState, KvCache, State

MAGIC = b"FJSNAP1\n"
SUFFIX = ".snap"
MAX_HEADER_BYTES = 64 * 2 ** 20


class Corrupt(Exception):
    """A snapshot file that must not be used; the message says why."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """A snapshot file's header."""

    path: Path
    position: int
    tokens: np.ndarray          # [position] int32
    parent: str | None          # the parent's file name
    parent_position: int
    layers: tuple[str, ...]     # per layer "kv" or "gdn"
    kv: dict                    # {"offset", "nbytes", "crc32", "arrays": [[shape], ...]}
    state: dict
    has_logits: bool
    kv_from: int = 0            # the first KV row it holds: parent_position, or one before
    has_hidden: bool = False    # State.hidden (the MTP layer), in the state section


def file_name(fingerprint: str, tokens: np.ndarray) -> str:
    h = hashlib.sha256(fingerprint.encode() + np.asarray(tokens, "<i4").tobytes())
    return h.hexdigest()[:40] + SUFFIX


def _section(arrays: list[np.ndarray], offset: int) -> tuple[dict, list[np.ndarray]]:
    arrays = [np.ascontiguousarray(a, "<f4") for a in arrays]
    crc = 0
    for a in arrays:
        crc = zlib.crc32(memoryview(a).cast("B"), crc)
    return ({"offset": offset, "nbytes": sum(a.nbytes for a in arrays), "crc32": crc,
             "arrays": [list(a.shape) for a in arrays]}, arrays)


def _read_header(f, path: Path, fingerprint: str) -> Entry:
    start = f.read(len(MAGIC) + 8)
    if len(start) < len(MAGIC) + 8 or start[:len(MAGIC)] != MAGIC:
        raise Corrupt("not a snapshot file (bad magic)")
    (n,) = struct.unpack("<Q", start[len(MAGIC):])
    if n > MAX_HEADER_BYTES:
        raise Corrupt(f"header of {n} bytes")
    raw = f.read(n)
    if len(raw) < n:
        raise Corrupt("truncated header")
    try:
        h = json.loads(raw)
        if h["fingerprint"] != fingerprint:
            raise Corrupt("written for another model (fingerprint differs)")
        tokens = np.asarray(h["tokens"], np.int32)
        base = len(MAGIC) + 8 + n
        entry = Entry(path, int(h["position"]), tokens, h["parent"], int(h["parent_position"]),
                      tuple(h["layers"]), h["kv"], h["state"], bool(h["has_logits"]),
                      int(h.get("kv_from", h["parent_position"])),
                      bool(h.get("has_hidden", False)))
        sections = [(entry.kv["offset"], entry.kv["nbytes"]),
                    (entry.state["offset"], entry.state["nbytes"])]
    except (ValueError, KeyError, TypeError) as e:
        raise Corrupt(f"unreadable header ({type(e).__name__}: {e})") from None
    if tokens.size != entry.position or entry.position < 1 \
            or path.name != file_name(fingerprint, tokens):
        raise Corrupt("header does not match its name")
    size = os.fstat(f.fileno()).st_size
    if size != base + sum(nbytes for _, nbytes in sections):
        raise Corrupt(f"truncated or padded ({size} bytes)")
    return dataclasses.replace(entry, kv={**entry.kv, "offset": base + entry.kv["offset"]},
                               state={**entry.state, "offset": base + entry.state["offset"]})


def _read_section(f, section: dict) -> list[np.ndarray]:
    f.seek(section["offset"])
    data = f.read(section["nbytes"])
    if len(data) != section["nbytes"]:
        raise Corrupt("truncated")
    if zlib.crc32(data) != section["crc32"]:
        raise Corrupt("checksum mismatch")
    arrays, at = [], 0
    for shape in section["arrays"]:
        n = 4 * int(np.prod(shape))
        arrays.append(np.frombuffer(data, "<f4", n // 4, at).reshape(shape))
        at += n
    if at != len(data):
        raise Corrupt("sections do not add up")
    return arrays


class SnapshotDir:
    """The snapshot files of one model in one directory."""

    def __init__(self, root: Path, fingerprint: str, check=None, warn=print):
        self.fingerprint, self.check, self.warn = fingerprint, check, warn
        self.dir = root / fingerprint[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FermijitError(f"--cache-dir {root}: cannot create it ({e.strerror})") from None
        self.entries: dict[str, Entry] = {}
        self.bad: set[str] = set()

    def _skip(self, name: str, why: str) -> None:
        self.bad.add(name)
        self.entries.pop(name, None)
        self.warn(f"warning: snapshot cache: skipped {self.dir / name}: {why}")

    def scan(self) -> None:
        """Read the headers of files not seen yet (this process's or another's)."""
        for name in os.listdir(self.dir):
            if not name.endswith(SUFFIX) or name in self.entries or name in self.bad:
                continue
            try:
                with open(self.dir / name, "rb") as f:
                    self.entries[name] = _read_header(f, self.dir / name, self.fingerprint)
            except Corrupt as e:
                self._skip(name, str(e))
            except OSError:
                pass  # gone since listed

    def _prefixes(self, tokens: np.ndarray, below: int) -> list[Entry]:
        """Entries whose tokens start `tokens`, deeper than `below`, deepest first."""
        found = [e for e in self.entries.values() if below < e.position <= tokens.size
                 and np.array_equal(e.tokens, tokens[:e.position])]
        return sorted(found, key=lambda e: -e.position)

    def best_load(self, prompt: np.ndarray,
                  below: int) -> tuple[State, np.ndarray | None] | None:
        """The deepest usable snapshot on disk of a prefix of `prompt` deeper than `below`
        (usable: leaves a token to prefill, or has the logits of the whole prompt), loaded."""
        self.scan()
        for entry in self._prefixes(prompt, below):
            if entry.path.name in self.bad or entry.position == prompt.size \
                    and not entry.has_logits:
                continue  # found bad as another's parent, or cannot serve the whole prompt
            try:
                return self._load(entry)
            except Corrupt as e:
                self._skip(entry.path.name, str(e))
        return None

    def _load(self, entry: Entry) -> tuple[State, np.ndarray | None]:
        chain = [entry]
        while chain[-1].parent is not None:
            parent = self.entries.get(chain[-1].parent)
            if parent is None or parent.position != chain[-1].parent_position \
                    or not np.array_equal(parent.tokens, entry.tokens[:parent.position]):
                raise Corrupt(f"its parent {chain[-1].parent} is missing or unusable")
            chain.append(parent)
        kv_pieces = []
        for e in reversed(chain):
            try:
                with open(e.path, "rb") as f:
                    fresh = _read_header(f, e.path, self.fingerprint)  # this inode's own
                    if fresh.position != e.position:
                        raise Corrupt("changed on disk")
                    kv_pieces.append((fresh.kv_from, _read_section(f, fresh.kv)))
                    if e is entry:
                        state_arrays = _read_section(f, fresh.state)
            except (Corrupt, OSError) as err:
                why = str(err) if isinstance(err, Corrupt) else f"unreadable ({err.strerror})"
                if e is entry:
                    raise Corrupt(why) from None
                self._skip(e.path.name, why)
                raise Corrupt(f"its parent {e.path.name} is unusable") from None
        layers, n_gdn = [], 0
        n_kv = entry.layers.count("kv")
        if len(state_arrays) != 2 * entry.layers.count("gdn") + entry.has_hidden \
                + entry.has_logits or any(len(rows) != 2 * n_kv for _, rows in kv_pieces):
            raise Corrupt("sections do not match its layers")
        end = 0
        for start, rows in kv_pieces:  # each piece from its kv_from: at or one before the last end
            if rows and not (end - 1 <= start <= end and (start == 0) == (end == 0)):
                raise Corrupt("its KV rows do not add up to its position")
            end = start + (rows[0].shape[1] if rows else 0)
        if n_kv and end != entry.position:
            raise Corrupt("its KV rows do not add up to its position")
        for i, kind in enumerate(entry.layers):
            if kind == "gdn":
                conv, recurrent = state_arrays[2 * n_gdn:2 * n_gdn + 2]
                layers.append(GdnState(conv.copy(), recurrent.copy()))
                n_gdn += 1
                continue
            j = len(layers) - n_gdn
            first = kv_pieces[0][1][2 * j]
            shape = (first.shape[0], entry.position, first.shape[2])
            k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)
            for start, rows in kv_pieces:  # later pieces overwrite the row they overlap
                k[:, start:start + rows[2 * j].shape[1]] = rows[2 * j]
                v[:, start:start + rows[2 * j + 1].shape[1]] = rows[2 * j + 1]
            layers.append(KvCache(k, v))
        hidden = state_arrays[2 * n_gdn].astype(np.float32) if entry.has_hidden else None
        state = State(entry.position, layers, hidden=hidden)
        if self.check is not None:
            try:
                self.check(state)
            except FermijitError as e:
                raise Corrupt(f"does not fit the model ({e})") from None
        logits = state_arrays[-1].astype(np.float32) if entry.has_logits else None
        return state, logits

    def write(self, tokens: np.ndarray, state: State, logits: np.ndarray | None) -> None:
        """Write a snapshot of `state` (which has seen `tokens`) unless it is on disk already."""
        name = file_name(self.fingerprint, tokens)
        path = self.dir / name
        if name in self.entries or path.exists() and name not in self.bad:
            return  # immutable: what is there serves (a bad one is written over)
        self.scan()
        parents = self._prefixes(tokens[:-1], 0)
        parent = parents[0] if parents else None
        start = 0 if parent is None else parent.position
        kv_from = start - 1 if start and state.hidden is not None else start  # the MTP row
        position = tokens.size
        kv_arrays = [a[:, kv_from:position] for s in state.layers if isinstance(s, KvCache)
                     for a in (s.k, s.v)]
        state_arrays = [a for s in state.layers if isinstance(s, GdnState)
                        for a in (s.conv, s.recurrent)]
        state_arrays += [] if state.hidden is None else [state.hidden]
        state_arrays += [] if logits is None else [logits]
        kv, kv_arrays = _section(kv_arrays, 0)
        st, state_arrays = _section(state_arrays, kv["nbytes"])
        header = json.dumps({
            "fingerprint": self.fingerprint, "position": position,
            "tokens": [int(t) for t in tokens],
            "parent": None if parent is None else parent.path.name, "parent_position": start,
            "layers": ["kv" if isinstance(s, KvCache) else "gdn" for s in state.layers],
            "kv": kv, "state": st, "has_logits": logits is not None, "kv_from": kv_from,
            "has_hidden": state.hidden is not None}).encode()
        tmp = None
        try:
            with tempfile.NamedTemporaryFile(dir=self.dir, prefix=".tmp-", suffix=".part",
                                             delete=False) as f:
                tmp = f.name
                f.write(MAGIC + struct.pack("<Q", len(header)) + header)
                for a in kv_arrays + state_arrays:
                    f.write(memoryview(a).cast("B"))
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep other users' processes out
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            self.warn(f"warning: snapshot cache: could not write {path}: {e.strerror}")
            return
        self.bad.discard(name)
        self.scan()  # registers it (or warns, should another process have spoilt it)
