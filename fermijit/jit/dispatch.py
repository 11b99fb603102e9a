"""Numba's dispatcher and disk cache for fermijit's kernels, made safe to share between processes
and lazier: what lets the warm-up compile in several processes at once (fermijit/warm.py).

- A kernel's declared signatures are compiled on their first use, not all at its creation: the
  GEMVs declared an output of one and of two dimensions and compiled both, 1.3 s of a first run
  of the REAP-128 model for a signature decode never called.
- A compile holds a lock named by its cache key in the cache folder, so two processes that need
  one kernel compile it once: the second waits, then loads it from the cache.
- Numba's index update is a read-modify-write of one file per kernel: two processes saving two
  signatures at once could both take data file 1, one index entry then naming the other's code.
  Saves take a lock of their own, and write the data before the index names it. A save also
  drops the entries of other versions of the source (KEY_VERSION), which Numba kept.
- Numba's settings that change the code it generates are part of the cache key (Numba's own key
  leaves them out: numba issue 10821), so a process run with one cannot serve its code to others.
- A code library compiled only to be linked into others gets no machine code of its own unless
  asked (below).
- A kernel calls its own copies of the code it links, never another library's (below).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import struct
import sys
import time

import llvmlite.binding as ll
import numpy as np
from numba.core import caching, codegen, sigutils
from numba.core import config as numba_config
from numba.core.registry import CPUDispatcher

LOCK_FILE = "fermijit-compile.lock"
# The longest kernel compile measured is ~2.5 s (issue 9 profile, under load); a lock held far
# longer belongs to a process that hangs (stopped, swapping): compile anyway, the saves stay safe.
WAIT_S = 120.0
POLL_S = 0.005

# Called (no arguments) before a kernel is compiled for want of a cached one: how the warm-up
# starts its helper processes on a first run only (fermijit/warm.py). Must not raise.
on_miss = None

_lock_fds: dict[str, int] = {}  # folder -> its lock file, open for the process's life: closing
# any descriptor of a file drops every POSIX lock the process holds on it


def _lock_byte(name: str) -> int:
    """Where `name` locks in the folder's lock file: one byte each (a collision only serialises
    two compiles, and the wait times out)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") & 0x7FFFFFFF


@contextlib.contextmanager
def folder_lock(folder: str, name: str, wait_s: float = WAIT_S):
    """Hold `name` exclusively among the processes sharing `folder` (released when the process
    dies, however it dies); yields whether it is held (False: the folder has no lock file to
    take, or the wait timed out; the caller goes on unlocked)."""
    fd = _lock_fds.get(folder)
    if fd is None:
        try:
            fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield False
            return
        _lock_fds[folder] = fd
    byte = _lock_byte(name)
    deadline = time.monotonic() + wait_s
    held = False
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte)
            held = True
            break
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
    try:
        yield held
    finally:
        if held:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, byte)


# The part of a SourceKeyedCache index key that names the code's version: the digests of the
# kernel's folder and of fermijit/jit (after Numba's signature, target and bytecode hashes).
KEY_VERSION = slice(3, 5)


class _LockedCacheFile(caching.IndexDataCacheFile):
    # A damaged index or data file (cut short: a crash before the data reached the disk, which
    # Numba never fsyncs, leaves empty files behind its renames; a full disk on a filesystem
    # whose rename is not atomic) raised pickle's UnpicklingError (or EOFError, ValueError...)
    # out of every run's first kernel, a traceback, until the folder was cleared by hand. Now
    # it is a cache miss, said once: the kernel compiles and its save writes the files anew.
    def _load_index(self):
        try:
            return super()._load_index()
        except Exception as e:
            _say_damaged(self._index_path, e)
            return {}

    def load(self, key):
        try:
            return super().load(key)
        except Exception as e:
            _say_damaged(self._cache_path, e)
            return None

    def save(self, key, data):
        with folder_lock(self._cache_path, "save " + self._index_name):
            overloads = self._load_index()
            # Entries of another version of the source can never be hit again (the digests are
            # of the code as it is): dropped with their data. Kept, each edit or upgrade added
            # an entry a kernel that every load of the index unpickled (Numba resets an index
            # only when the kernel's own file changes): a long-lived checkout's 74 indexes held
            # 5565 entries, 18 MB, 0.26-0.45 s of serve's warm-up, against 0.03 s fresh.
            for stale in [k for k in overloads if k[KEY_VERSION] != key[KEY_VERSION]]:
                with contextlib.suppress(OSError):
                    os.unlink(self._data_path(overloads.pop(stale)))
            data_name = overloads.get(key)
            if data_name is None:
                taken = set(overloads.values())
                data_name = next(name for name in map(self._data_name, range(1, len(taken) + 2))
                                 if name not in taken)
            self._save_data(data_name, data)  # first: an index entry always names whole data
            overloads[key] = data_name
            self._save_index(overloads)


# Numba's settings (numba.core.config, mostly NUMBA_<name> variables) that change generated code
# and are not in Numba's cache key (the CPU name and features are). Issue 9: one profiling run with
# NUMBA_DEBUGINFO=1 (also implied by NUMBA_ENABLE_PROFILING=1) saved kernels compiled with debug
# info (variables kept alive, calls not inlined, loops not vectorised) under the plain key; every
# later process loaded them: the gated norm [512, 8, 64] 0.2 -> 2.1 ms, SwiGLU's 0.13 -> 1.9 ms.
CODEGEN_SETTINGS = ("DEBUGINFO_DEFAULT", "EXTEND_VARIABLE_LIFETIMES", "BOUNDSCHECK", "OPT",
                    "LOOP_VECTORIZE", "SLP_VECTORIZE", "USING_SVML", "DEBUG_ARRAY_OPT_RUNTIME",
                    "LLVM_REFPRUNE_PASS", "LLVM_REFPRUNE_FLAGS", "JIT_COVERAGE")


def codegen_settings() -> tuple:
    """The values of CODEGEN_SETTINGS now (read at each use: Numba reloads its config)."""
    return tuple(str(getattr(numba_config, name, None)) for name in CODEGEN_SETTINGS)


# Numba refreshes the target context before every load from the cache, "to ensure it is
# initialized": the first refresh imports Numba's implementations (linalg, random, typed
# containers...: 0.09 s on 2 cores) and installs their registries, each later one looks for new
# registrations (57 of them 0.007 s in serve's warm-up). A load needs none of it: it unpickles
# the code and links it against the runtime (NRT, started here: what the refresh did that a
# load needs), and a compile (a cache miss) refreshes the context itself (its pipeline does).
# Issue 28 item 4. FERMIJIT_LOAD_REFRESH=1: every load refreshes, as Numba's does.
LOAD_REFRESH_ENV = "FERMIJIT_LOAD_REFRESH"
_runtime_started: set[int] = set()  # id()s of target contexts (they live for ever)
_save_failure_said = False
_damage_said = False


def _say_damaged(where: str, e: Exception) -> None:
    global _damage_said
    if not _damage_said:
        _damage_said = True
        print(f"fermijit: a damaged kernel cache file in {where} ({type(e).__name__}): its "
              f"kernels are compiled again", file=sys.stderr)


class SourceKeyedCache(caching.FunctionCache):
    """Numba's cache notices edits to the kernel's own file only, not to the intrinsics or
    helpers it calls in other modules (notes, pitfall 6). Adding a digest of the kernel's folder
    and of fermijit/jit to the index key makes any such edit a cache miss; adding
    `codegen_settings()` keeps code compiled under other Numba settings apart. Saves are
    locked."""

    def __init__(self, py_func, extra_key: tuple):
        super().__init__(py_func)
        self._extra_key = extra_key
        self._cache_file.__class__ = _LockedCacheFile

    def _index_key(self, sig, codegen):
        numba_key = super()._index_key(sig, codegen)
        assert len(numba_key) == KEY_VERSION.start, "Numba's index key changed: see KEY_VERSION"
        return numba_key + self._extra_key + codegen_settings()

    def load_overload(self, sig, target_context):
        if os.environ.get(LOAD_REFRESH_ENV) == "1":
            cres = super().load_overload(sig, target_context)  # Numba's: refreshed, then loaded
        else:
            if id(target_context) not in _runtime_started:
                from numba.core.runtime import rtsys

                rtsys.initialize(target_context)
                _runtime_started.add(id(target_context))
            with self._guard_against_spurious_io_errors():
                cres = self._load_overload(sig, target_context)
        args, _ = sigutils.normalize_signature(sig)
        if cres is not None and tuple(cres.signature.args) != tuple(args):
            cres = None  # another signature's code (an index written by an older fermijit)
        if cres is None and on_miss is not None:
            on_miss()
        return cres

    def save_overload(self, sig, data):
        """A save that fails (the disk full, the folder made read-only since it was found
        writable) costs only the next run's load: the kernel compiled here runs all the same.
        Numba raised the OSError out of the compile, and every model command died of a full
        disk ("Error: No space left on device"). Said once a process."""
        global _save_failure_said
        try:
            super().save_overload(sig, data)
        except OSError as e:
            if not _save_failure_said:
                _save_failure_said = True
                print(f"fermijit: could not save compiled kernels in {self._cache_path}: "
                      f"{e.strerror or e}; the next run compiles them again", file=sys.stderr)

    def compile_lock_name(self, sig, codegen) -> str:
        return f"compile {self._cache_file._index_name} {self._index_key(sig, codegen)!r}"

    @property
    def folder(self) -> str:
        return self._cache_path


class Dispatcher(CPUDispatcher):
    """A CPUDispatcher whose `declared` signatures (if any) are the only ones it compiles, each
    on its first use, and whose compiles are locked among processes sharing its cache."""

    declared: tuple = ()

    def declare(self, signatures) -> None:
        self.declared = tuple(signatures)

    def compile(self, sig):
        called, _ = sigutils.normalize_signature(sig)
        if self.declared:
            sig = self._declared_for(sig)
        args, _ = sigutils.normalize_signature(sig)
        cache = self._cache
        if tuple(args) in self.overloads or not isinstance(cache, SourceKeyedCache):
            entry = super().compile(sig)
        else:
            with folder_lock(cache.folder, cache.compile_lock_name(sig, self.targetctx.codegen())):
                entry = super().compile(sig)
        if tuple(called) != tuple(args):
            # While it may compile, Numba's dispatch takes exact argument types only: every call
            # converting one (a writable array for a read-only one) came back here through Python
            # (~150 us a GEMV). The declared code takes these types as they are (Numba's own
            # conversions call it so): enter it under them too.
            self._insert([a._code for a in called], entry, False)
        if self.declared and len(self.overloads) == len(self.declared):
            self.disable_compile()  # all there: Numba's own dispatch from now on
        return entry

    def _declared_for(self, sig):
        """The declared signature that arguments of types `sig` convert to (as Numba's dispatch
        converts them to compiled ones); a TypeError, as Numba's, if none does."""
        args, _ = sigutils.normalize_signature(sig)
        for declared in self.declared:
            if tuple(declared.args) == tuple(args):
                return declared
        match = self.typingctx.resolve_overload(self.py_func, list(self.declared), args, {},
                                                allow_ambiguous=False)
        if match is None:
            raise TypeError("No matching definition for argument type(s) "
                            + ", ".join(map(str, args)))
        return match


# --- code libraries compiled only to be linked into others ---------------------------------------
# Numba finalizes every library it links into another: optimises it and generates its machine
# code in the JIT. A library first finalized that way (made by `compile_subroutine`: the fork
# shares of jit/omp.py, parfor bodies, Numba's own overloads) is never called on its own: every
# caller links a copy of its IR, optimises it with its own code (O3 again) and generates code for
# that. So such a library is not optimised alone, and its machine code waits until something asks
# for it (an address, its object code), which nothing in fermijit does: asked, it would be code
# from the function passes only, slow but right. Issue 9: the full-size warm-up in one process,
# machine code 7.8 -> 5.6 s, final optimisation 7.1 -> 4.3 s; prefill and decode bits unchanged.

_original_add_linking_library = codegen.CPUCodeLibrary.add_linking_library
_original_add_module = codegen.JITCPUCodegen._add_module
_original_finalize_specific = codegen.JITCodeLibrary._finalize_specific
_original_get_pointer = codegen.JITCodeLibrary.get_pointer_to_function
_original_compiled_object = codegen.CPUCodeLibrary._get_compiled_object
_original_optimize_final_module = codegen.CPUCodeLibrary._optimize_final_module


def _add_linking_library(self, library):
    if not library._finalized:
        library._link_only = True  # finalized here first: made for linking
    _original_add_linking_library(self, library)


def _optimize_final_module(self):
    if not getattr(self, "_link_only", False):
        _original_optimize_final_module(self)


def _library_of(module):
    return getattr(module, "_CPUCodeLibrary__library", None)  # set by finalize, a weak proxy


def _add_module(self, module):
    library = _library_of(module)
    if library is not None and getattr(library, "_link_only", False):
        library._deferred_module = module
        return None
    _own_copies(library, module)
    return _original_add_module(self, module)


def _finalize_specific(self):
    if getattr(self, "_deferred_module", None) is None:
        _original_finalize_specific(self)


def _materialise(library):
    module = getattr(library, "_deferred_module", None)
    if module is not None:
        library._deferred_module = None
        library._link_only = False
        _own_copies(library, module)
        _original_add_module(library._codegen, module)
        _original_finalize_specific(library)


def _get_pointer_to_function(self, name):
    self._ensure_finalized()
    _materialise(self)
    return _original_get_pointer(self, name)


def _get_compiled_object(self):
    _materialise(self)
    return _original_compiled_object(self)


# --- each kernel calls its own copies ----------------------------------------------------------
# A caller's copies of the code it links come in as linkonce_odr: weak symbols in its object code,
# which the JIT resolves to the first definition of that name it has, wherever it is. The copies
# are optimised again in each caller (fast-math reassociates differently), so which copy a kernel
# ran depended on what the process had loaded before: the process that compiled attention's
# kernel ran the range kernel's own library (strong, compiled alone), every later process, which
# loads only the caller from the cache, the caller's copy: other bits (issue 9: ~1e-7 for 8 query
# heads a kv head at head dim 256, head dims 32, 48, 60). Made internal in the code given to the
# JIT (after optimisation, so the same code), each caller keeps its copies; the module others link
# still offers them as linkonce_odr.

_original_module_for_linking = codegen.CPUCodeLibrary._get_module_for_linking


def _own_copies(library, module) -> None:
    if library is None:
        return
    names = [fn.name for fn in module.functions
             if not fn.is_declaration and fn.linkage == ll.Linkage.linkonce_odr]
    for name in names:
        module.get_function(name).linkage = ll.Linkage.internal
    library._own_copies = names


def _get_module_for_linking(self):
    """Numba's, this library's own copies linkonce_odr again (made internal only for the JIT)."""
    is_new = self._shared_module is None
    module = _original_module_for_linking(self)
    names = getattr(self, "_own_copies", ())
    if is_new and names:
        if module is self._final_module:
            module = self._shared_module = module.clone()
        for name in names:  # (each keeps the dso_local that internal linkage set: no other change)
            module.get_function(name).linkage = ll.Linkage.linkonce_odr
    return module


codegen.CPUCodeLibrary.add_linking_library = _add_linking_library
codegen.CPUCodeLibrary._get_module_for_linking = _get_module_for_linking
codegen.CPUCodeLibrary._optimize_final_module = _optimize_final_module
codegen.JITCPUCodegen._add_module = _add_module
codegen.JITCodeLibrary._finalize_specific = _finalize_specific
codegen.JITCodeLibrary.get_pointer_to_function = _get_pointer_to_function
codegen.CPUCodeLibrary._get_compiled_object = _get_compiled_object


# --- a cached kernel's linking module parsed only when something links it -----------------------
# Loading a kernel from the cache parsed the LLVM bitcode of its module for linking (kept for a
# later kernel that links it: none, with a warm cache) and walked it for the names it defines
# (whether the JIT holds a symbol): 0.15 s of the 0.7 s that serve's warm-up spends loading 57
# kernels (issue 28 item 4). The names come from the object code's ELF symbol table instead
# (the global and weak definitions: what the JIT can be asked for), and the bitcode is parsed
# on first use. Object code that is not 64-bit little-endian ELF takes Numba's way.

_original_unserialize = codegen.CPUCodeLibrary._unserialize.__func__

_ELF_SYMBOL = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                        ("value", "<u8"), ("size", "<u8")])


def elf_defined_symbols(object_code: bytes) -> set[str] | None:
    """The names an ELF64 little-endian object defines with global or weak binding; None for
    anything else (or a malformed one)."""
    try:
        if object_code[:6] != b"\x7fELF\x02\x01":
            return None
        shoff, = struct.unpack_from("<Q", object_code, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", object_code, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", object_code, shoff + i * shentsize)
                    for i in range(shnum)]
        names = set()
        for _, kind, _, _, offset, size, link, _, _, entsize in sections:
            if kind != 2 or entsize != _ELF_SYMBOL.itemsize:  # SHT_SYMTAB
                continue
            strtab = sections[link]
            strings = object_code[strtab[4]:strtab[4] + strtab[5]]
            symbols = np.frombuffer(object_code, _ELF_SYMBOL, size // entsize, offset)
            binding = symbols["info"] >> 4
            for at in symbols["name"][((binding == 1) | (binding == 2))
                                      & (symbols["shndx"] != 0) & (symbols["name"] != 0)]:
                names.add(strings[at:strings.index(b"\0", at)].decode())
        return names
    except (struct.error, ValueError, IndexError):
        return None


def _unserialize(cls, codegen_, state):
    name, kind, data = state
    names = elf_defined_symbols(data[0]) if kind == "object" else None
    if names is None:
        return _original_unserialize(cls, codegen_, state)
    library = codegen_.create_library(name)
    object_code, shared_bitcode = data
    library.enable_object_caching()
    library._set_compiled_object(object_code)
    library._lazy_shared_bitcode = shared_bitcode
    library._finalize_final_module()
    codegen_._engine._defined_symbols |= names
    return library


def _get_module_for_linking_lazily(self):
    bitcode = getattr(self, "_lazy_shared_bitcode", None)
    if bitcode is not None and self._shared_module is None:
        self._shared_module = ll.parse_bitcode(bitcode)
        self._lazy_shared_bitcode = None
    return _get_module_for_linking(self)


codegen.CPUCodeLibrary._unserialize = classmethod(_unserialize)
codegen.CPUCodeLibrary._get_module_for_linking = _get_module_for_linking_lazily


# --- Numba's LLVM-lock events ----------------------------------------------------------------
# Numba wraps every llvmlite call in a pair of Python callbacks broadcasting "numba:llvm_lock"
# events (~4 us a call): they feed only its compile metadata's timers and its event listeners,
# which fermijit reads nowhere, and a serve's start makes ~3,500 llvmlite calls loading its 58
# kernels (0.015-0.035 s of ~1 s on 2 cores, issue 28 item 4). Dropped, unless NUMBA_CHROME_TRACE
# asks for Numba's trace (which shows them).


def _drop_llvm_lock_events() -> None:
    from llvmlite.binding import ffi

    if numba_config.CHROME_TRACE:
        return
    callbacks = getattr(getattr(ffi.lib, "_lock", None), "_cblist", None)
    for acquired, released in list(callbacks or ()):
        if getattr(acquired, "__module__", None) == "numba.core.base":
            ffi.unregister_lock_callback(acquired, released)


_drop_llvm_lock_events()
