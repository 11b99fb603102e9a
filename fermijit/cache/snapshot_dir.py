"""The snapshot prefix cache on disk (`--cache-dir DIR`): snapshots that survive
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

The header names the model's fingerprint, the tokens, the parent, the arrays of each section
(shapes; "dtypes" where not all are fp32: a Q8_0 KV cache's int8 codes and fp32 scales,
with "kv_cache": "q8_0") and each section's CRC-32. Files of an fp32 cache are as before that. Headers are read when the directory is scanned (at each lookup, so other
processes' files are seen); the arrays only when a snapshot is used (lazily), and only the KV
section of its ancestors. A corrupt, truncated or foreign-model file, or one whose parent is
missing, is skipped with one warning line, never used.

The directory is shared (replicas behind a load balancer), so its files are untrusted input:
only regular files are opened, headers are read with the CLI's JSON rules
and every field is checked (a parent lies below its child's position, so chains end), and
restored arrays must be finite. A CRC anyone can recompute; with a key (`--cache-key`) each
section carries an HMAC-SHA256 and the header one over its canonical JSON (the sections' HMACs
included), and a file without them is skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model.files import open_regular, parse_json, short
from fermijit.model.state import GdnState, KvCache, KvKind, State
from fermijit.ops.kv_quant import Q8Rows

MAGIC = b"FJSNAP1\n"
SUFFIX = ".snap"
MAX_HEADER_BYTES = 64 * 2 ** 20
MAX_POSITION = 2 ** 31 - 1  # positions and token ids are int32


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
    kv_kind: KvKind
    kv: dict                    # {"offset", "nbytes", "crc32", "arrays": [[shape], ...]}
    state: dict
    has_logits: bool
    kv_from: int = 0            # the first KV row it holds: parent_position, or one before
    has_hidden: bool = False    # State.hidden (the MTP layer), in the state section


def file_name(fingerprint: str, tokens: np.ndarray) -> str:
    h = hashlib.sha256(fingerprint.encode() + np.asarray(tokens, "<i4").tobytes())
    return h.hexdigest()[:40] + SUFFIX


DTYPES = {"<f4": np.dtype("<f4"), "|i1": np.dtype("i1")}  # what sections hold


def _section(arrays: list[np.ndarray], offset: int) -> tuple[dict, list[np.ndarray]]:
    arrays = [np.ascontiguousarray(a, "i1" if a.dtype == np.int8 else "<f4") for a in arrays]
    crc = 0
    for a in arrays:
        crc = zlib.crc32(memoryview(a).cast("B"), crc)
    section = {"offset": offset, "nbytes": sum(a.nbytes for a in arrays), "crc32": crc,
               "arrays": [list(a.shape) for a in arrays]}
    if any(a.dtype != np.float32 for a in arrays):
        section["dtypes"] = [a.dtype.str for a in arrays]
    return section, arrays


def _read_header(f, path: Path, fingerprint: str, key: bytes | None) -> Entry:
    """The header of the open snapshot file `f`, every field checked (Corrupt otherwise): the
    directory is shared, so anyone who can write there may have made the file."""
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
        h = parse_json(raw, "header")  # the CLI's JSON rules: depth, digits, no NaN/Infinity
    except FermijitError as e:
        raise Corrupt(str(e)) from None
    if not isinstance(h, dict):
        raise Corrupt("header is not a JSON object")
    if h.get("fingerprint") != fingerprint:
        raise Corrupt("written for another model (fingerprint differs)")
    if key is not None and not hmac.compare_digest(str(h.get("mac")), _header_mac(key, h)):
        raise Corrupt("not signed with this --cache-key")
    position = _count(h.get("position"), "position", 1, MAX_POSITION)
    tokens = h.get("tokens")
    if not (isinstance(tokens, list) and len(tokens) == position
            and all(type(t) is int and 0 <= t <= MAX_POSITION for t in tokens)):
        raise Corrupt(f"tokens are not {position} token ids")
    tokens = np.asarray(tokens, np.int32)
    if path.name != file_name(fingerprint, tokens):
        raise Corrupt("header does not match its name")
    parent = h.get("parent")
    if parent is None:
        parent_position = _count(h.get("parent_position"), "parent_position", 0, 0)
    else:
        if not (isinstance(parent, str) and parent.endswith(SUFFIX) and "/" not in parent
                and parent != path.name):
            raise Corrupt(f"its parent {short(parent)} is not another snapshot's file name")
        # below its own position: a chain of parents ends (no loop)
        parent_position = _count(h.get("parent_position"), "parent_position", 1, position - 1)
    layers = h.get("layers")
    if not (isinstance(layers, list) and all(kind in ("kv", "gdn") for kind in layers)):
        raise Corrupt("layers are not a list of \"kv\" and \"gdn\"")
    if type(h.get("has_logits")) is not bool:
        raise Corrupt("has_logits is not true or false")
    # the MTP layer's cache lags one row: a file of such a state holds its KV rows from one
    # before its parent's end (absent: written before MTP states, from the parent's end)
    kv_from = _count(h.get("kv_from", parent_position), "kv_from", max(parent_position - 1, 0),
                     parent_position)
    if type(h.get("has_hidden", False)) is not bool:
        raise Corrupt("has_hidden is not true or false")
    kv_cache = h.get("kv_cache", "f32")  # absent: written before Q8_0 caches
    if kv_cache not in ("f32", "q8_0"):
        raise Corrupt(f"kv_cache is not \"f32\" or \"q8_0\": {short(kv_cache)}")
    base = len(MAGIC) + 8 + n
    size = os.fstat(f.fileno()).st_size
    kv, state = (_checked_section(h.get(name), name, size - base) for name in ("kv", "state"))
    if size != base + kv["nbytes"] + state["nbytes"]:
        raise Corrupt(f"truncated or padded ({size} bytes)")
    return Entry(path, position, tokens, parent, parent_position, tuple(layers),
                 KvKind(kv_cache), {**kv, "offset": base + kv["offset"]},
                 {**state, "offset": base + state["offset"]}, h["has_logits"], kv_from,
                 h.get("has_hidden", False))


def _count(value, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise Corrupt(f"{what} is not an integer in [{low}, {high}]: {short(value)}")
    return value


def _checked_section(section, name: str, room: int) -> dict:
    """A section's record: offset and nbytes within the `room` after the header, its arrays'
    shapes (non-negative) and types (DTYPES; fp32 when "dtypes" is absent) adding up to
    nbytes."""
    if not isinstance(section, dict):
        raise Corrupt(f"{name} is not an object")
    offset = _count(section.get("offset"), f"{name}.offset", 0, room)
    nbytes = _count(section.get("nbytes"), f"{name}.nbytes", 0, room - offset)
    _count(section.get("crc32"), f"{name}.crc32", 0, 2 ** 32 - 1)
    shapes = section.get("arrays")
    if not (isinstance(shapes, list) and all(
            isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
            for shape in shapes)):
        raise Corrupt(f"{name}.arrays are not shapes")
    dtypes = section.get("dtypes", ["<f4"] * len(shapes))
    if not (isinstance(dtypes, list) and len(dtypes) == len(shapes)
            and all(isinstance(t, str) and t in DTYPES for t in dtypes)):
        raise Corrupt(f"{name}.dtypes are not one known type per array")
    if sum(DTYPES[t].itemsize * math.prod(shape)  # Python ints: no overflow
           for t, shape in zip(dtypes, shapes)) != nbytes:
        raise Corrupt(f"{name}: its arrays do not add up to its {nbytes} bytes")
    return section


def _read_section(f, section: dict, key: bytes | None) -> list[np.ndarray]:
    f.seek(section["offset"])
    data = f.read(section["nbytes"])
    if len(data) != section["nbytes"]:
        raise Corrupt("truncated")
    if zlib.crc32(data) != section["crc32"]:
        raise Corrupt("checksum mismatch")
    if key is not None and not hmac.compare_digest(str(section.get("mac")),
                                                   _mac(key, [data])):
        raise Corrupt("a section does not match its --cache-key signature")
    arrays, at = [], 0
    dtypes = section.get("dtypes", ["<f4"] * len(section["arrays"]))  # checked with the header
    for shape, name in zip(section["arrays"], dtypes):
        dtype = DTYPES[name]
        n = math.prod(shape)
        arrays.append(np.frombuffer(data, dtype, n, at).reshape(shape))
        at += n * dtype.itemsize
    if at != len(data):
        raise Corrupt("sections do not add up")
    if any(a.dtype.kind == "f" and not np.isfinite(a).all() for a in arrays):
        raise Corrupt("holds NaN or infinite values")
    return arrays


def _mac(key: bytes, pieces) -> str:
    """HMAC-SHA256 of the bytes of `pieces` (bytes or arrays, in order), hex."""
    m = hmac.new(key, digestmod=hashlib.sha256)
    for piece in pieces:
        m.update(piece if isinstance(piece, bytes) else memoryview(piece).cast("B"))
    return m.hexdigest()


def _header_mac(key: bytes, header: dict) -> str:
    """The MAC of a header, "mac" left out: over its canonical JSON, so that it covers what is
    read from it (the sections' MACs included), however the file spelled it."""
    fields = {k: v for k, v in header.items() if k != "mac"}
    return _mac(key, [b"fermijit snapshot header\n",
                      json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()])


def _open(path: Path):
    """A snapshot file opened for reading: regular files only (a FIFO named x.snap hung every
    reader for ever; a device never ends)."""
    try:
        return open_regular(path)
    except FermijitError as e:
        raise Corrupt(str(e).removeprefix(f"{path}: ")) from None


class SnapshotDir:
    """The snapshot files of one model in one directory."""

    def __init__(self, root: Path, fingerprint: str, check=None, warn=print,
                 key: bytes | None = None):
        self.fingerprint, self.check, self.warn, self.key = fingerprint, check, warn, key
        self.dir = root / fingerprint[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FermijitError(f"--cache-dir {root}: cannot create it ({e.strerror})") from None
        self.entries: dict[str, Entry] = {}
        self.bad: set[str] = set()
        # The errno of the write that failed last, until one succeeds: a full disk or a folder
        # made read-only fails every save alike, and each said so (a warning per snapshot: 35
        # lines for one 541-token prompt, and a server's log filled); said once until then.
        self.failing: int | None = None

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
                with _open(self.dir / name) as f:
                    self.entries[name] = _read_header(f, self.dir / name, self.fingerprint,
                                                      self.key)
            except Corrupt as e:
                if os.path.lexists(self.dir / name):  # else gone since listed
                    self._skip(name, str(e))

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
                    or not np.array_equal(parent.tokens, entry.tokens[:parent.position]) \
                    or parent.kv_kind is not entry.kv_kind:
                raise Corrupt(f"its parent {chain[-1].parent} is missing or unusable")
            chain.append(parent)
        kv_pieces = []
        for e in reversed(chain):
            try:
                with _open(e.path) as f:
                    fresh = _read_header(f, e.path, self.fingerprint, self.key)  # this inode's
                    if fresh.position != e.position:
                        raise Corrupt("changed on disk")
                    kv_pieces.append((fresh.kv_from, _read_section(f, fresh.kv, self.key)))
                    if e is entry:
                        state_arrays = _read_section(f, fresh.state, self.key)
            except (Corrupt, OSError) as err:
                why = str(err) if isinstance(err, Corrupt) else f"unreadable ({err.strerror})"
                if e is entry:
                    raise Corrupt(why) from None
                self._skip(e.path.name, why)
                raise Corrupt(f"its parent {e.path.name} is unusable") from None
        layers, n_gdn = [], 0
        n_kv = entry.layers.count("kv")
        per_kv = 2 if entry.kv_kind is KvKind.F32 else 4  # k, v; or their codes and scales
        if len(state_arrays) != 2 * entry.layers.count("gdn") + entry.has_hidden \
                + entry.has_logits or any(len(rows) != per_kv * n_kv for _, rows in kv_pieces):
            raise Corrupt("sections do not match its layers")
        if any(a.ndim != 3 for _, rows in kv_pieces for a in rows):
            raise Corrupt("its KV rows are not [heads, positions, dim]")
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
            first = kv_pieces[0][1][per_kv * j]
            cache = KvCache.zeros(entry.kv_kind, first.shape[0], entry.position, first.shape[2])
            try:
                for start, rows in kv_pieces:  # later pieces overwrite the row they overlap
                    mine = rows[per_kv * j:per_kv * (j + 1)]
                    cache.put(start, KvCache(*mine) if per_kv == 2 else
                              KvCache(Q8Rows(*mine[:2]), Q8Rows(*mine[2:])))
            except ValueError:
                raise Corrupt("its KV rows do not fit together") from None
            layers.append(cache)
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
        kv_layers = [s for s in state.layers if isinstance(s, KvCache)]
        kv_arrays = [a for s in kv_layers for a in s.rows(kv_from, position).arrays]
        state_arrays = [a for s in state.layers if isinstance(s, GdnState)
                        for a in (s.conv, s.recurrent)]
        state_arrays += [] if state.hidden is None else [state.hidden]
        state_arrays += [] if logits is None else [logits]
        kv, kv_arrays = _section(kv_arrays, 0)
        st, state_arrays = _section(state_arrays, kv["nbytes"])
        header = {
            "fingerprint": self.fingerprint, "position": position,
            "tokens": [int(t) for t in tokens],
            "parent": None if parent is None else parent.path.name, "parent_position": start,
            "layers": ["kv" if isinstance(s, KvCache) else "gdn" for s in state.layers],
            "kv": kv, "state": st, "has_logits": logits is not None, "kv_from": kv_from,
            "has_hidden": state.hidden is not None,
            **({"kv_cache": state.kv_kind.value} if state.kv_kind is KvKind.Q8_0 else {})}
        if self.key is not None:  # --cache-key: each section signed, then the header
            kv["mac"], st["mac"] = _mac(self.key, kv_arrays), _mac(self.key, state_arrays)
            header["mac"] = _header_mac(self.key, header)
        header = json.dumps(header).encode()
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
            if e.errno != self.failing:
                self.warn(f"warning: snapshot cache: could not write {path}: {e.strerror} (the "
                          f"next snapshots that fail alike are not said)")
            self.failing = e.errno
            return
        self.failing = None
        self.bad.discard(name)
        self.scan()  # registers it (or warns, should another process have spoilt it)
