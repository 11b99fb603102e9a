"""serve's GPU start begun at exec (issue 28 item 4), on a thread from the CLI's `main`, before
the commands' imports (numba's ~0.4 s) and the model's load:

  1. the model's weights file mapped read-only exactly as the loader maps it (its data region,
     np.memmap's offset rounding): SafetensorsFile.mapped takes this mapping (`take_mapping`),
     so the addresses registered below are the ones the experts' views live at;
  2. the driver started: cuInit and device 0's primary context (fermijit's: gpu.driver retains
     it), through ctypes, which releases the GIL;
  3. the mapping registered with the driver (cuMemHostRegister, read-only) in `page_chunks`, on
     REGISTER_THREADS threads, as expert_stream._register_in_place registers it: gpu.register
     adopts each chunk registered here (`take_registration`) instead of registering it again.

The registration (1.1-1.25 s for the 11 GB reap128 file on the H200's host) had begun only once
the model was loaded (~0.9 s after exec), and the GPU's path was the start's critical one. All
that the GPU's preparation does not adopt (it fell back to the CPU; the experts come from a pool
or a ring; the file changed) is unregistered by `release`. No driver, a refusal (Fermi's drivers
cannot register read-only; RLIMIT_MEMLOCK): nothing stays registered, and the preparation does
what it did without this, saying why where it did. Standard library only: it runs before numpy
is imported.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import threading
import time

from fermijit import env_number

# The model file is registered with the driver in chunks of this many bytes: pinning its pages
# holds the process's memory-map lock (~0.6 s for the whole 11 GB file at once on the H200's
# host), which every mmap of another thread waits for (the CPU kernels' loading beside it maps
# its code); a copy is cut where one chunk ends (gpu.split_at_registrations).
# 64 MiB against 256 on the H200's host, serve's exec -> ready (medians): 2.84 vs 3.13 s in one
# run (3 rounds), 3.49 vs 3.45 s in another (5 rounds): alike within the noise; 16 MiB 4.03 s.
REGISTER_CHUNK_BYTES = 64 << 20
REGISTER_CHUNK_ENV = "FERMIJIT_REGISTER_CHUNK"  # MiB: another chunk (the start bench's A/B)
# Threads registering the chunks at once (each call releases the GIL; the driver pins each
# chunk's pages itself: ~0.8 s of the server's GPU start for the 11 GB file on one thread, on the
# H200's host); FERMIJIT_REGISTER_THREADS sets it (1: one after the other, as before).
REGISTER_THREADS = 4
REGISTER_THREADS_ENV = "FERMIJIT_REGISTER_THREADS"
# cuMemHostRegister's flags (cuda.h): READ_ONLY since CUDA 11.1, so the pages of a read-only
# file mapping can be locked; a driver without it (Fermi's last, 390.x: CUDA 9.1) refuses.
REGISTER_PORTABLE, REGISTER_READ_ONLY = 0x01, 0x08


def chunk_bytes() -> int:
    """The registration chunk: REGISTER_CHUNK_ENV MiB where set, else REGISTER_CHUNK_BYTES."""
    return int(env_number(REGISTER_CHUNK_ENV, 0) * (1 << 20)) or REGISTER_CHUNK_BYTES


def register_threads() -> int:
    return max(1, env_number(REGISTER_THREADS_ENV, REGISTER_THREADS, int))


def page_chunks(address: int, nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """(address, bytes) pieces of at most `chunk` (whole pages) covering the pages of
    [address, address + nbytes)."""
    page = mmap.PAGESIZE
    chunk = max(page, chunk // page * page)
    first = address // page * page
    last = -(-(address + nbytes) // page) * page
    return [(at, min(chunk, last - at)) for at in range(first, last, chunk)]


# The loader waits at most this long for the early mapping (made within milliseconds of the
# plan's imports), else maps the file itself: a stall there never stalls the load.
MAPPING_WAIT_S = 10.0


def _load_driver():
    return ctypes.CDLL("libcuda.so.1")  # OSError: no driver


class _Mapping:
    """The data region of a safetensors file mapped as np.memmap(path, uint8, "r",
    offset=data_start, shape=(data_nbytes,)) maps it."""

    def __init__(self, path: str, max_register_bytes: int | None):
        # O_NONBLOCK: a FIFO with no writer would block the open (model/files.py open_regular)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            head = os.pread(fd, 8, 0) if stat.S_ISREG(st.st_mode) else b""
            header_nbytes = int.from_bytes(head, "little") if len(head) == 8 else -1
            self.data_start = 8 + header_nbytes
            self.data_nbytes = st.st_size - self.data_start
            # Anything odd (not a regular file, a corrupt header): the loader says what.
            if header_nbytes < 0 or self.data_nbytes <= 0:
                raise ValueError("not a safetensors file the loader would map")
            start = self.data_start - self.data_start % mmap.ALLOCATIONGRANULARITY
            self.mm = mmap.mmap(fd, st.st_size - start, access=mmap.ACCESS_READ, offset=start)
        finally:
            os.close(fd)
        self.address = _address(self.mm) + self.data_start - start  # of the data region
        self.is_registrable = max_register_bytes is None or self.data_nbytes <= max_register_bytes

    def holds(self, path, data_start: int, data_nbytes: int) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return ((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == self.identity
                and (data_start, data_nbytes) == (self.data_start, self.data_nbytes))


class _Buffer(ctypes.Structure):
    """Python's Py_buffer (Include/pybuffer.h)."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int),
                ("ndim", ctypes.c_int), ("format", ctypes.c_char_p),
                ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


def _address(mm: mmap.mmap) -> int:
    """Where a read-only mmap's bytes are (ctypes' from_buffer takes writable buffers only)."""
    view = _Buffer()
    get, release = ctypes.pythonapi.PyObject_GetBuffer, ctypes.pythonapi.PyBuffer_Release
    get.argtypes = [ctypes.py_object, ctypes.POINTER(_Buffer), ctypes.c_int]
    release.argtypes = [ctypes.POINTER(_Buffer)]
    if get(mm, ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE
        raise ValueError("no buffer")
    try:
        return view.buf
    finally:
        release(ctypes.byref(view))


class _Start:
    """One process's early start: its mapping, the chunks it registered and not yet handed on."""

    def __init__(self, plan):
        self.plan, self.on_thread = plan, None
        self.mapping: _Mapping | None = None
        self.mapped = threading.Event()    # the mapping made, or not to be
        self.finished = threading.Event()  # the registration done, given up or refused
        self.lock = threading.Lock()
        self.registered: set[tuple[int, int]] = set()  # not yet adopted by gpu.register
        self.n_chunks = self.n_adopted = 0
        self.is_stopping = False
        self.lib = self.context = None
        self.began = self.ended = None      # the registration's, on perf_counter's clock

    def run(self) -> None:
        # The driver's start (cuInit: 0.1-0.3 s in C, the GIL released) beside the plan's
        # imports (numpy's, which the commands import anyway) and the mapping.
        driver = threading.Thread(target=self._start_driver, name="fermijit-early-cuinit",
                                  daemon=True)
        driver.start()
        try:
            planned = self.plan() if self.plan is not None else None
            if planned is not None:
                path, max_register_bytes, self.on_thread = planned
                self.mapping = _Mapping(str(path), max_register_bytes)
        except Exception:  # noqa: BLE001 - the loader maps the file itself, says what is wrong
            pass
        finally:
            self.mapped.set()
        try:
            driver.join()
            if self.context is not None and self.mapping is not None \
                    and self.mapping.is_registrable:
                self._register(self.mapping)
        finally:
            self.finished.set()

    def _start_driver(self) -> None:
        try:
            lib = _load_driver()
            device, context = ctypes.c_int(), ctypes.c_void_p()
            if (lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(device), 0) == 0
                    and lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0):
                self.lib, self.context = lib, context
        except (OSError, AttributeError):
            pass  # the GPU's preparation says why, as always

    def _register(self, mapping: _Mapping) -> None:
        pieces = page_chunks(mapping.address, mapping.data_nbytes, chunk_bytes())
        todo = iter(pieces)
        refused = []
        self.began = time.perf_counter()

        def work() -> None:
            try:
                if self.on_thread is not None:
                    self.on_thread(mapping.address, mapping.data_nbytes)  # --numa's policy
                self.lib.cuCtxSetCurrent(self.context)
                while not (refused or self.is_stopping):
                    with self.lock:
                        piece = next(todo, None)
                    if piece is None:
                        return
                    at, n = piece
                    if self.lib.cuMemHostRegister_v2(ctypes.c_void_p(at), ctypes.c_size_t(n),
                                                     REGISTER_PORTABLE | REGISTER_READ_ONLY):
                        refused.append(piece)
                        return
                    with self.lock:
                        self.registered.add(piece)
            except Exception:  # noqa: BLE001 - then the normal path registers, as without this
                refused.append(None)

        threads = [threading.Thread(target=work, name=f"fermijit-early-register-{n}",
                                    daemon=True)
                   for n in range(min(len(pieces), register_threads()))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.ended = time.perf_counter()
        self.n_chunks = len(pieces)
        if refused or self.is_stopping:  # all or nothing, as _register_in_place
            self.unregister()

    def unregister(self) -> None:
        """Unregister the chunks not adopted."""
        with self.lock:
            left, self.registered = sorted(self.registered), set()
        if not left:
            return
        self.lib.cuCtxPushCurrent_v2(self.context)
        for at, _ in left:
            self.lib.cuMemHostUnregister(ctypes.c_void_p(at))
        self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


_start: _Start | None = None


def start(plan=None) -> None:
    """On a thread: `plan()` (None: no plan) -> (path, max_register_bytes, on_thread) or None;
    `path` (a model's safetensors weights file) mapped, the driver started and, where the file's
    data region is at most `max_register_bytes` (None: any), the mapping registered, each
    registering thread first calling `on_thread(address, nbytes)` (None: nothing) with the data
    region: the weights' NUMA policy, so the pages go where the loader's would."""
    global _start
    _start = _Start(plan)
    threading.Thread(target=_start.run, name="fermijit-early-driver", daemon=True).start()


def take_mapping(path, data_start: int, data_nbytes: int) -> mmap.mmap | None:
    """The early mapping, an mmap from data_start rounded down to ALLOCATIONGRANULARITY, where it
    holds `path`'s data region (the same file, unchanged); else None."""
    s = _start
    if s is None or s.plan is None or not s.mapped.wait(MAPPING_WAIT_S):
        return None
    m = s.mapping
    return m.mm if m is not None and m.holds(path, data_start, data_nbytes) else None


def take_registration(address: int, nbytes: int) -> bool:
    """Whether [address, address + nbytes) was registered here (once the registration is done):
    from now on the caller's (gpu.register), who unregisters it."""
    s = _start
    if s is None:
        return False
    s.finished.wait()
    with s.lock:
        if (address, nbytes) not in s.registered:
            return False
        s.registered.discard((address, nbytes))
        s.n_adopted += 1
        return True


def release() -> None:
    """Stop registering, unregister whatever was not adopted and drop this module's reference to
    the mapping (the loader's arrays keep it mapped): the GPU's preparation calls it once it has
    its experts' source, or has failed."""
    s = _start
    if s is None:
        return
    s.is_stopping = True
    s.finished.wait()
    s.unregister()
    s.mapping = None


def registration() -> dict | None:
    """The early registration's figures, where it registered: {"began", "ended" (perf_counter),
    "chunks", "adopted"}; else None."""
    s = _start
    if s is None or s.began is None:
        return None
    return {"began": s.began, "ended": s.ended, "chunks": s.n_chunks, "adopted": s.n_adopted}
