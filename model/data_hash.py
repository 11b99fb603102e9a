"""sha256 of a file's bytes, for caches keyed on data, without reading the file
on every run: the digest is recorded in the local cache with the file's stamp (size, mtime_ns,
ctime_ns, inode, device) and read again only when the stamp changed. ctime is in the stamp
because nobody can set it: a file rewritten in place with its old mtime put back (`touch -d`)
still hashes again.

What needs it: snapshots of an HF checkpoint (its headers stayed the same when weights of the same
shapes were saved over it, and the old snapshots answered), and the conversion of a GGUF file
(keyed by size and header, it ran the old conversion of changed data).

Records live in cache_root()/hashes, one small JSON per file (named by its resolved path); one
that cannot be read or written only costs a hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from fermijit import FermijitError, user_cache_dir
from fermijit.model.files import open_regular, read_json

CHUNK_NBYTES = 16 << 20
SHOW_PROGRESS_NBYTES = 1 << 30  # hashing a file this large shows a progress bar (~3 s/GiB here)


def cache_root() -> Path:
    """$FERMIJIT_CACHE, else $XDG_CACHE_HOME/fermijit, else ~/.cache/fermijit; a FermijitError
    where there is no home (Path.home()'s RuntimeError had been a traceback)."""
    base = os.environ.get("FERMIJIT_CACHE")
    if base:
        return Path(base)
    user = user_cache_dir()
    if user is None:
        raise FermijitError("no folder for fermijit's cache: HOME is not set and this user has "
                            "no home directory (set FERMIJIT_CACHE)")
    return user / "fermijit"


def file_sha256(path: str | Path) -> str:
    """sha256 hex of the bytes of `path`, from its record when the file's stamp is unchanged."""
    path = Path(path).resolve()
    st = os.stat(path)
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    try:
        record = cache_root() / "hashes" / (hashlib.sha256(str(path).encode()).hexdigest()[:32]
                                            + ".json")
    except FermijitError:
        return _hash(path, st.st_size)  # no cache folder: hashed on every run
    try:
        known = read_json(record)
        if known.get("path") == str(path) and known.get("stamp") == stamp \
                and isinstance(known.get("sha256"), str):
            return known["sha256"]
    except FermijitError:
        pass  # none yet, or unreadable: hash again
    digest = _hash(path, st.st_size)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps({"path": str(path), "stamp": stamp, "sha256": digest}))
        os.replace(partial, record)
    except OSError:
        pass  # a read-only cache: the next run hashes again
    return digest


def _hash(path: Path, nbytes: int) -> str:
    from tqdm import tqdm

    h = hashlib.sha256()
    with open_regular(path) as f, tqdm(total=nbytes, unit="B", unit_scale=True,
                                       desc=f"hashing {path.name}", file=sys.stderr,
                                       disable=nbytes < SHOW_PROGRESS_NBYTES) as bar:
        while piece := f.read(CHUNK_NBYTES):
            h.update(piece)
            bar.update(len(piece))
    return h.hexdigest()
