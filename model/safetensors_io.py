"""safetensors, read by memory map and written in place, without the `safetensors` package.

A file is: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data, offsets relative to its
start. Reading maps the data region once and hands out views: a 67 GB checkpoint never becomes
Python objects. BF16 has no numpy dtype: it is held as its uint16 bit pattern and widened to fp32
by a 16-bit shift (bf16 is the top half of an fp32).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import mmap
import os
import struct
import threading
from pathlib import Path

import numpy as np

from fermijit import FermijitError, env_number
from fermijit.jit import gpu_early
from fermijit.model.files import (guard_mapping, member, open_regular, parse_json, read_json,
                                  short, watch_mapping)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# __metadata__ "format" of a fermijit model's weights file (model/convert.py write_model)
FERMIJIT_FORMAT = "fermijit"
MAX_HEADER_NBYTES = 100 * 1024 * 1024  # the safetensors package's own limit
# Beyond any real tensor; numpy refuses dims past 2**63 (an OverflowError) even in empty arrays.
MAX_NDIM, MAX_DIM = 16, 1 << 48
MADV_POPULATE_READ = 22  # linux/mman.h (Python's mmap module names it from 3.13 only)
DATA_ALIGN = 64  # we pad our headers so data, and each 16-byte-multiple tensor, is aligned

# safetensors dtype -> numpy storage dtype (BF16 as its bit pattern).
STORAGE = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"),
           "F64": np.dtype("<f8"), "I8": np.dtype("i1"), "U8": np.dtype("u1"),
           "I16": np.dtype("<i2"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8"),
           "BOOL": np.dtype("?")}
FLOAT_DTYPES = ("BF16", "F16", "F32")
_NUMPY_TO_ST = {np.dtype("<f2"): "F16", np.dtype("<f4"): "F32", np.dtype("<f8"): "F64",
                np.dtype("i1"): "I8", np.dtype("u1"): "U8", np.dtype("<i2"): "I16",
                np.dtype("<i4"): "I32", np.dtype("<i8"): "I64", np.dtype("?"): "BOOL"}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> fp32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> uint16 bf16 bit patterns, rounded to nearest even (as torch); NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


class TensorInfo:
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], begin: int, end: int):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


# MiB a populate call covers (SafetensorsFile.populate); FERMIJIT_POPULATE_CHUNK sets it
# ("whole": the whole file in one call, as before).
POPULATE_CHUNK_MIB = 32
POPULATE_CHUNK_ENV = "FERMIJIT_POPULATE_CHUNK"
# The background populate's thread at this niceness: where cores are few it yields them to the
# start's kernel warm-up (on 2 cores, populating beside it had made the warm-up 1.29x slower);
# where they are many it takes an idle one anyway. FERMIJIT_POPULATE_NICE (0: not niced).
POPULATE_NICE = 10
POPULATE_NICE_ENV = "FERMIJIT_POPULATE_NICE"
# Background populates asked for inside `populate_after` (serve's load and kernel warm-up) begin
# when it ends. Beside the warm-up, populating made loading the cached kernels ~3x slower on the
# 2-core machine (0.25 -> 0.75 s of 58 kernels: the JIT maps and protects their code while the
# populate fills the file's page tables, the process's memory map shared by both); after it the
# populate ends ~1 s into serving. FERMIJIT_POPULATE_AFTER=0: at once, as before.
POPULATE_AFTER_ENV = "FERMIJIT_POPULATE_AFTER"
_held: list | None = None  # the held populates' thread starts, inside populate_after


@contextlib.contextmanager
def populate_after():
    """Hold the background populates asked for inside the block until it ends (dropped where
    it raises: a start that failed exits without populating)."""
    global _held
    if os.environ.get(POPULATE_AFTER_ENV) == "0" or _held is not None:
        yield
        return
    _held = []
    try:
        yield
    except BaseException:
        _held = None
        raise
    held, _held = _held, None
    for start in held:
        start()


class SafetensorsFile:
    """One .safetensors file, header parsed and checked; tensors are read-only memmap views."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open_regular(self.path) as f:
                file_nbytes = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    self._bad("shorter than the 8-byte header length")
                (header_nbytes,) = struct.unpack("<Q", head)
                if header_nbytes > MAX_HEADER_NBYTES or 8 + header_nbytes > file_nbytes:
                    self._bad(f"header length {header_nbytes} does not fit the file "
                              f"({file_nbytes} bytes)")
                header_bytes = f.read(header_nbytes)
        except OSError as e:
            raise FermijitError(f"cannot read {self.path}: {e.strerror}") from None
        header = parse_json(header_bytes, f"{self.path}: corrupt safetensors file: header")
        if not isinstance(header, dict):
            self._bad("header is not a JSON object")
        self.data_start = 8 + header_nbytes
        self.data_nbytes = file_nbytes - self.data_start
        self.metadata = header.pop("__metadata__", None) or {}
        if not (isinstance(self.metadata, dict)
                and all(isinstance(v, str) for v in self.metadata.values())):
            self._bad(f"__metadata__ is not an object of strings: {short(self.metadata)}")
        self.tensors = {name: self._info(name, entry) for name, entry in header.items()}
        # Byte ranges in order, none overlapping: a tensor aliasing another's bytes is corruption
        # (issue 11: overlapping ranges ran to exit 0 with changed output). Duplicate names were
        # refused by the JSON reader.
        end, last = 0, None
        for info in sorted(self.tensors.values(), key=lambda t: (t.begin, t.end)):
            if info.begin < end:
                self._bad(f"{info.name} (bytes {info.begin}-{info.end}) overlaps {last.name} "
                          f"(bytes {last.begin}-{last.end})")
            end, last = info.end, info
        self._data = None

    def _bad(self, why: str):
        raise FermijitError(f"{self.path}: corrupt safetensors file: {why}")

    def _info(self, name: str, entry) -> TensorInfo:
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = (isinstance(dtype, str) and dtype in STORAGE
                  and len(shape) <= MAX_NDIM and all(type(n) is int and 0 <= n < MAX_DIM
                                                     for n in shape)
                  and type(begin) is int and type(end) is int)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            self._bad(f"bad header entry for {name!r}: {short(entry)}")
        nbytes = math.prod(shape) * STORAGE[dtype].itemsize  # Python ints: no wrap-around
        if end - begin != nbytes or begin < 0:
            self._bad(f"{name}: data_offsets {[begin, end]} do not hold {dtype} {list(shape)}")
        if end > self.data_nbytes:
            self._bad(f"{name} ends at byte {end} of {self.data_nbytes} (truncated?)")
        return TensorInfo(name, dtype, shape, begin, end)

    def mapped(self) -> np.ndarray:
        """The data region as one read-only uint8 map (made on first use)."""
        if self._data is None:
            guard_mapping(self.path)
            self._data = (_map(self.path, self.data_start, self.data_nbytes)
                          if self.data_nbytes else np.zeros(0, np.uint8))
            watch_mapping(self.path, self._data)
        return self._data

    def populate(self, background: bool = False) -> bool:
        """Fault every page of the data region into this process's page tables now, reading
        what is not cached (Linux's MADV_POPULATE_READ; llama.cpp maps with MAP_POPULATE for the
        same reason): decode then takes no first-touch faults. On the full-size REAP-128 model
        each new expert's pages faulted in as routing first reached it, ~3000 faults a token
        over the first ~50 tokens; populating its 11.5 GB from the page cache takes ~1 s.
        `background`: on a thread (the call releases the GIL), so the start's other work (the
        GPU's start) runs meanwhile, begun at once or, inside `populate_after`, when it ends;
        True at once. False where the kernel
        cannot (before 5.14). In pieces of POPULATE_CHUNK_ENV MiB (default POPULATE_CHUNK_MIB):
        one call over the whole file holds the process's memory-map lock for its second, and
        every other thread's mmap or munmap (the kernels' loading maps their code) waits behind
        it (issue 28 item 4)."""
        data = self.mapped()
        if not isinstance(data, np.memmap) or data._mmap is None:
            return False
        page = mmap.PAGESIZE
        first = data.ctypes.data // page * page  # the mapping starts on a page at or before it
        length = data.ctypes.data + data.nbytes - first
        whole = os.environ.get(POPULATE_CHUNK_ENV, "").strip() == "whole"
        chunk = length if whole else max(page, int(env_number(
            POPULATE_CHUNK_ENV, POPULATE_CHUNK_MIB) * (1 << 20)) // page * page)
        # Read here, not on the thread: a bad value raised there went unsaid past its traceback.
        nice = env_number(POPULATE_NICE_ENV, POPULATE_NICE, int, minimum=-20)

        def advise() -> bool:
            return all(madvise(at, min(chunk, first + length - at), MADV_POPULATE_READ)
                       for at in range(first, first + length, chunk))

        def advise_niced() -> bool:
            if nice:
                try:  # this thread only (Linux: a thread's id is a process id to setpriority)
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
                except (OSError, AttributeError):
                    pass
            return advise()

        if background:
            start = threading.Thread(target=advise_niced, name="fermijit-populate",
                                     daemon=True).start
            if _held is None:
                start()
            else:
                _held.append(start)
            return True
        return advise()

    def raw(self, name: str) -> np.ndarray:
        """The stored tensor, as a read-only view of the map (BF16 as uint16)."""
        info = self.tensors[name]
        return self.mapped()[info.begin:info.end].view(STORAGE[info.dtype]).reshape(info.shape)


def _map(path: Path, offset: int, nbytes: int) -> np.memmap:
    """`nbytes` of `path` from `offset`, a read-only np.memmap: the mapping serve's start made at
    exec where it is this file's (fermijit/jit/gpu_early.py: registered with the driver meanwhile,
    at these addresses), else a new one."""
    mm = gpu_early.take_mapping(path, offset, nbytes)
    if mm is None:
        return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))
    start = offset - offset % mmap.ALLOCATIONGRANULARITY  # where np.memmap starts its mmap
    data = np.ndarray.__new__(np.memmap, (nbytes,), np.uint8, buffer=mm, offset=offset - start)
    data._mmap, data.offset, data.mode, data.filename = mm, offset, "r", path.resolve()
    return data


class Checkpoint:
    """The tensors of a directory: `model.safetensors`, or the shards an index file names."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FermijitError(f"no such model directory: {self.directory}")
        index = self.directory / INDEX_NAME
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not (isinstance(weight_map, dict)
                    and all(isinstance(v, str) for v in weight_map.values())):
                raise FermijitError(f"{index}: not a safetensors index (weight_map is not an "
                                    f"object of file names)")
            shard_names = sorted(set(weight_map.values()))
            for shard in shard_names:  # names checked before anything is opened
                member(self.directory, shard, f"{index}: weight_map")
        elif (self.directory / SINGLE_NAME).exists():
            weight_map, shard_names = None, [SINGLE_NAME]
        else:
            raise FermijitError(f"{self.directory}: no {SINGLE_NAME} or {INDEX_NAME}")
        self.files = []
        self._where: dict[str, SafetensorsFile] = {}
        for shard in shard_names:
            if not (self.directory / shard).exists():
                raise FermijitError(f"{self.directory / shard}: shard named in the index is missing")
            f = SafetensorsFile(self.directory / shard)
            self.files.append(f)
            for name in f.tensors:
                if name in self._where:
                    raise FermijitError(f"{f.path}: tensor {name} is also in "
                                        f"{self._where[name].path}")
                self._where[name] = f
        for name, shard in (weight_map or {}).items():
            if self._where.get(name) is None or self._where[name].path.name != shard:
                raise FermijitError(f"{index}: {name} is not in {shard}")

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        return self._where[name].tensors[name]

    def path_of(self, name: str) -> Path:
        return self._where[name].path

    def raw(self, name: str) -> np.ndarray:
        return self._where[name].raw(name)

    def float32(self, name: str, index=()) -> np.ndarray:
        """`tensor[index]` as a new fp32 array (BF16/F16/F32 sources only)."""
        info = self.info(name)
        if info.dtype not in FLOAT_DTYPES:
            raise FermijitError(f"{name}: dtype {info.dtype} is not one of {FLOAT_DTYPES}")
        part = self.raw(name)[index]
        if info.dtype == "BF16":
            return bf16_to_f32(part)
        return part.astype(np.float32)


class SafetensorsWriter:
    """Writes a file whose tensors are all declared up front; each is filled by one or more
    `write` calls, at any position and in any order, so a converter streams tensor pieces
    through bounded memory. `close` checks that every byte was written exactly once.
    """

    def __init__(self, path: str | Path, specs: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self._infos: dict[str, TensorInfo] = {}
        offset = 0
        for name, dtype, shape in specs:
            if dtype not in STORAGE or name in self._infos or name == "__metadata__":
                raise FermijitError(f"{self.path}: bad tensor spec {name!r} {dtype}")
            nbytes = math.prod(shape) * STORAGE[dtype].itemsize
            self._infos[name] = TensorInfo(name, dtype, tuple(shape), offset, offset + nbytes)
            header[name] = {"dtype": dtype, "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % DATA_ALIGN)  # the spec allows trailing spaces
        self._data_start = 8 + len(text)
        self._written: dict[str, list[tuple[int, int]]] = {name: [] for name in self._infos}
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, struct.pack("<Q", len(text)) + text, 0)
        os.ftruncate(self._fd, self._data_start + offset)

    def dtype_of(self, name: str) -> np.dtype:
        """The numpy dtype `write` takes for tensor `name`."""
        return STORAGE[self._infos[name].dtype]

    def write(self, name: str, array: np.ndarray, start: int = 0) -> None:
        """Store `array` as elements [start, start + array.size) of tensor `name` (row-major).
        BF16 tensors take uint16 bit patterns; others take their own numpy dtype.
        """
        info = self._infos[name]
        if np.dtype(array.dtype) != STORAGE[info.dtype]:
            raise FermijitError(f"{self.path}: {name} is {info.dtype}, got a {array.dtype} array")
        item = STORAGE[info.dtype].itemsize
        begin = info.begin + start * item
        end = begin + array.size * item
        if start < 0 or end > info.end:
            raise FermijitError(f"{self.path}: write past the end of {name}")
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # no copy
        at = self._data_start + begin
        while data:  # pwrite may write less than asked
            n = os.pwrite(self._fd, data, at)
            data, at = data[n:], at + n
        spans = self._written[name]
        if spans and spans[-1][1] == begin:  # sequential pieces merge: O(1) bookkeeping
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((begin, end))

    def close(self) -> None:
        os.close(self._fd)
        for name, spans in self._written.items():
            info, at = self._infos[name], self._infos[name].begin
            for begin, end in sorted(spans):
                if begin != at:
                    break
                at = end
            if at != info.end or sum(e - b for b, e in spans) != info.end - info.begin:
                raise FermijitError(f"{self.path}: tensor {name} was not written exactly once")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            os.close(self._fd)


def save_file(path: str | Path, tensors: dict[str, np.ndarray],
              metadata: dict[str, str] | None = None, bf16: frozenset[str] = frozenset()) -> None:
    """Write whole arrays; names in `bf16` are fp32 arrays stored as BF16 (rounded)."""
    specs = []
    for name, a in tensors.items():
        dtype = "BF16" if name in bf16 else _NUMPY_TO_ST.get(np.dtype(a.dtype).newbyteorder("<"))
        if dtype is None:
            raise FermijitError(f"{path}: {name} has unsupported dtype {a.dtype}")
        specs.append((name, dtype, a.shape))
    with SafetensorsWriter(path, specs, metadata) as w:
        for name, a in tensors.items():
            w.write(name, f32_to_bf16(a) if name in bf16 else a)


def madvise(address: int, length: int, advice: int) -> bool:
    """madvise(2) on raw addresses (a memmap's own pages, which Python's mmap object cannot name
    by address), releasing the GIL while the kernel works; False where it refuses."""
    return _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0


@functools.lru_cache(maxsize=None)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
