"""Every file fermijit reads from a model directory or from the user goes through here:
one path rule, one JSON reader, one text reader. Bad input is a one-line FermijitError.

- Path rule: a file named inside a model file (`weights` in fermijit.json, shards in the index)
  must be a bare file name, checked before anything is opened, so a model cannot point at
  `/etc/passwd` or `../x`; and only regular files are opened (a FIFO would block for ever, a
  device never ends). Symbolic links are followed: HF cache snapshots are links into `blobs/`.
- JSON: NaN/Infinity literals and floats that overflow to infinity are refused, as are duplicate
  keys (two entries for one tensor), integers of more than MAX_INT_DIGITS digits (Python's own
  limit is 4300, a ValueError), nesting deeper than MAX_JSON_DEPTH (a RecursionError) and files
  over a size cap.
- Text (a prompt, `eval --text`): strict UTF-8, at most MAX_TEXT_BYTES.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import weakref
from pathlib import Path

from fermijit import FermijitError

MAX_JSON_BYTES = 64 << 20   # the largest we read: a sharded checkpoint's index, ~2 MB for 35B
MAX_JSON_DEPTH = 32         # the deepest file we read (tokenizer_config.json) nests 4 deep
MAX_INT_DIGITS = 20         # 2**64 has 20 digits: no count or offset we read needs more
# A prompt or an evaluated text: the real model's whole context (262144 tokens) is ~1 MB of
# text; 64 MiB bounds what `generate < /dev/zero` reads before it says so.
MAX_TEXT_BYTES = 64 << 20


def member(directory: str | Path, name, what: str) -> Path:
    """`directory / name` for a file name read from a model file (`what` names where)."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
            or "\0" in name):
        raise FermijitError(f"{what}: {short(name)} is not a bare file name (no folders, no ..)")
    return Path(directory) / name


def open_regular(path: str | Path):
    """`path` opened for binary reading; FermijitError unless it is a regular file."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer would otherwise block before fstat can look.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise FermijitError(f"{path}: cannot open ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FermijitError(f"{path}: not a regular file ({kind_of(mode)})")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def kind_of(mode: int) -> str:
    """What a file that is not a regular one is, for a message."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "of another kind"


def read_bytes(path: str | Path, limit: int, what: str = "file") -> bytes:
    """The whole of a regular file of at most `limit` bytes."""
    with open_regular(path) as f:
        try:
            # read(n) allocates n bytes first: ask for the file's size, not the limit.
            data = f.read(min(os.fstat(f.fileno()).st_size, limit) + 1)
        except OSError as e:
            raise FermijitError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) > limit:
        raise FermijitError(f"{path}: {what} larger than {limit >> 20} MiB")
    return data


def short(value, n: int = 80) -> str:
    """A JSON value for an error message: one line, at most `n` characters."""
    try:
        text = ascii(value) if isinstance(value, str) else json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


class _Refused(ValueError):
    pass


def _constant(literal: str):
    raise _Refused(f"{literal} is not a number JSON allows")


def _float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused(f"{literal[:40]} overflows a float")
    return value


def _int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(literal)} digits")
    return int(literal)


def _object(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _Refused(f"the key {short(key)} appears twice")
    return out


def _depth_ok(value) -> bool:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return False
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return True


def parse_json(data: bytes | str, where: str):
    """The JSON value of `data`; `where` starts the error message (a path, say)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int,
                           object_pairs_hook=_object)
    except UnicodeDecodeError as e:
        raise FermijitError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except _Refused as e:
        raise FermijitError(f"{where}: refused JSON: {e}") from None
    except json.JSONDecodeError as e:
        raise FermijitError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column "
                            f"{e.colno})") from None
    except RecursionError:
        raise FermijitError(f"{where}: refused JSON: nested too deeply") from None
    if not _depth_ok(value):
        raise FermijitError(f"{where}: refused JSON: nested more than {MAX_JSON_DEPTH} deep")
    return value


def read_json(path: str | Path, limit: int = MAX_JSON_BYTES) -> dict:
    """A JSON file holding an object."""
    value = parse_json(read_bytes(path, limit, "JSON file"), str(path))
    if not isinstance(value, dict):
        raise FermijitError(f"{path}: expected a JSON object, got {short(value)}")
    return value


def check_text(text: str, where: str) -> str:
    """`text` unless it holds what UTF-8 cannot encode (argv bytes that were not UTF-8 arrive
    as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FermijitError(f"{where}: not valid UTF-8 (at character {e.start})") from None
    if len(text) > MAX_TEXT_BYTES:
        raise FermijitError(f"{where}: larger than {MAX_TEXT_BYTES >> 20} MiB")
    return text


def read_text(stream_or_path, where: str) -> str:
    """UTF-8 text from a binary stream (stdin) or a file (a pipe too), at most MAX_TEXT_BYTES."""
    try:
        if isinstance(stream_or_path, (str, Path)):
            with open(stream_or_path, "rb") as f:
                data = f.read(MAX_TEXT_BYTES + 1)
        else:
            data = stream_or_path.read(MAX_TEXT_BYTES + 1)
    except OSError as e:
        raise FermijitError(f"{where}: cannot read ({e.strerror})") from None
    if len(data) > MAX_TEXT_BYTES:
        raise FermijitError(f"{where}: larger than {MAX_TEXT_BYTES >> 20} MiB (the most fermijit "
                            f"reads as text)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FermijitError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None


# --- SIGBUS from a mapped file that shrank -------------------------------------------------------
# A weights file truncated (or replaced in place) under a running model makes the next read of a
# missing page a SIGBUS: the process died with no message. Python's own handlers run between
# bytecodes, never inside the faulting read, so the handler is eight machine instructions,
# write(2, message) then exit_group(2), both async-signal-safe and needing no GIL (a Numba worker
# thread may be the one faulting). x86-64 Linux only (the project's targets); elsewhere the
# default action stays. Replace model files by rename, never in place (README).
_SIGBUS_CODE = bytes.fromhex(
    "bf02000000"      # mov edi, 2                (fd: stderr)
    "488d3534000000"  # lea rsi, [rip + 52]       (the message, at offset 64)
    "ba00000000"      # mov edx, <length>         (patched at offset 13)
    "b801000000"      # mov eax, 1                (SYS_write)
    "0f05"            # syscall
    "bf02000000"      # mov edi, 2                (exit status)
    "b8e7000000"      # mov eax, 231              (SYS_exit_group)
    "0f05")           # syscall
_SIGBUS_MESSAGE_AT, _SIGBUS_PAGE = 64, 4096
_sigbus_page = None
_mapped: list[str] = []


def guard_mapping(path: str | Path) -> None:
    """From now on a SIGBUS prints one line naming the mapped files, and exits 2."""
    import ctypes
    import mmap
    import platform
    import signal
    import sys

    global _sigbus_page
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return
    if str(path) not in _mapped:
        _mapped[:] = _mapped[-3:] + [str(path)]  # the latest few: one model at a time runs
    message = (f"Error: {', '.join(_mapped)} changed while mapped (SIGBUS: truncated or "
               f"rewritten in place; replace model files by rename)\n").encode(errors="replace")
    message = message[:_SIGBUS_PAGE - _SIGBUS_MESSAGE_AT]
    first = _sigbus_page is None
    if first:
        _sigbus_page = mmap.mmap(-1, _SIGBUS_PAGE,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        _sigbus_page[:len(_SIGBUS_CODE)] = _SIGBUS_CODE
    # Length first, then text: a fault in between prints a prefix of the new message.
    _sigbus_page[_SIGBUS_MESSAGE_AT:_SIGBUS_MESSAGE_AT + len(message)] = message
    _sigbus_page[13:17] = len(message).to_bytes(4, "little")
    if first:
        libc = ctypes.CDLL(None)
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal.restype = ctypes.c_void_p
        address = ctypes.addressof(ctypes.c_char.from_buffer(_sigbus_page))
        libc.signal(int(signal.SIGBUS), address)


# --- a mapped file rewritten in place, its size kept ----------------------------------------------
# No SIGBUS then: the mapping's pages simply hold the new bytes, and the model answers from a
# mix of two weights files without a word (serve, the embedded model, temperature 0: "ash\n\nThe
# `fractions` module", then "" once the file's second half was rewritten in place, both 200).
# A descriptor of each mapped file is kept while its mapping lives (the inode mapped: a file
# replaced by rename, as the README asks, is another inode, and the mapping goes on reading the
# old one, whole), and its size and modification time are compared by `check_mappings`, an
# fstat (~1 us): by the server before each step, by generate and eval at their end. A `touch`
# counts as a rewrite. Mapping a path again watches the new mapping only (a model loaded again
# after its file changed is the new file's).
_watched: dict[int, tuple[str, int, tuple[int, int]]] = {}  # key -> (path, fd, stamp)
_watch_keys = itertools.count()


def _stamp(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def watch_mapping(path: str | Path, data) -> None:
    """Watch file `path`, mapped as the array `data`, for `check_mappings` while `data` lives."""
    path = str(path)
    for key in [k for k, (p, _, _) in _watched.items() if p == path]:
        _unwatch(key)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    key = next(_watch_keys)
    _watched[key] = (path, fd, _stamp(fd))
    weakref.finalize(data, _unwatch, key)


def _unwatch(key: int) -> None:
    entry = _watched.pop(key, None)
    if entry is not None:
        os.close(entry[1])


def check_mappings() -> None:
    """A FermijitError if a mapped weights file changed in place since it was mapped."""
    for path, fd, stamp in list(_watched.values()):
        if _stamp(fd) != stamp:
            raise FermijitError(f"{path} changed while mapped (rewritten in place since it was "
                                f"loaded: what the model computes now may mix two files; "
                                f"replace model files by rename)")
