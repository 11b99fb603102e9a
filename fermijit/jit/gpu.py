"""The GPU side of the JIT: pycuda availability, loading rendered PTX, checked launches.

Importing this module never imports pycuda. `unavailable_reason()` says why GPU paths cannot run
(no pycuda, no driver, no device); `kernel()` raises that reason as a FermijitError. PTX is loaded
with the driver's cuModuleLoadDataEx (through ctypes, the GIL released: `launch_way`; or
`pycuda.driver.module_from_buffer`), so the driver JIT-compiles the `.target sm_20` text for
whatever GPU is present and nvcc is never needed (DESIGN.md, GPU prefill). pycuda keeps the
context, the device memory and the streams.

Arrays: an op's `gpu(...)` takes numpy arrays or `pycuda.gpuarray.GPUArray`s. With numpy inputs
it copies them in and returns numpy, so it is a drop-in for `cpu(...)`; when its first input is
already on the device the result stays there (prefill chains kernels without host round trips).
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import functools
import os
import struct
import sys
import threading
import time
import warnings
import weakref
from contextlib import contextmanager

import numpy as np

from fermijit import FermijitError
from fermijit.jit import checks, gpu_early, ptx
from fermijit.jit.gpu_early import REGISTER_PORTABLE, REGISTER_READ_ONLY

# Fermi's launch limits (sm_20); newer GPUs allow more, the engine must not rely on it.
FERMI_MAX_GRID = (65535, 65535, 65535)

_context = None
# pycuda keeps a stack of current contexts per thread: the one context is pushed on every thread
# that asks for the driver (the server loads on one thread and prefills on another), and popped
# by `release_thread` before that thread ends (pycuda aborts the process when a thread ends with
# its stack not empty).
_thread = threading.local()


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """None when a CUDA device can be used through pycuda, else a one-line reason."""
    try:
        import pycuda.driver as cuda
    except ImportError as e:
        return f"pycuda is not installed (pip install 'fermijit[gpu]'): {e}"
    try:
        cuda.init()
        if cuda.Device.count() == 0:
            return "the CUDA driver sees no device"
    except cuda.Error as e:
        return f"the CUDA driver failed to start: {e}"
    return None


def driver():
    """`pycuda.driver`, with fermijit's context current on the calling thread (the device 0
    primary context, unless the first caller already had one current)."""
    global _context
    reason = unavailable_reason()
    if reason is not None:
        raise FermijitError(f"no GPU: {reason}")
    import pycuda.driver as cuda

    if _context is None:
        current = cuda.Context.get_current()
        if current is None:
            current = cuda.Device(0).retain_primary_context()
            current.push()
            _thread.pushed = True
            atexit.register(_release)
        _context = current
        _thread.has_context = True
    elif not getattr(_thread, "has_context", False):
        current = cuda.Context.get_current()
        if current is None or current.handle != _context.handle:
            _context.push()
            _thread.pushed = True
        _thread.has_context = True
    return cuda


def release_thread() -> None:
    """Pop the context `driver` pushed on this thread, if it did: call it before a thread that
    used the GPU ends."""
    if getattr(_thread, "pushed", False):
        import pycuda.driver as cuda

        cuda.Context.pop()
    _thread.pushed = _thread.has_context = False


def _release() -> None:
    global _context
    if _context is None:
        return
    cuda = driver()
    cuda.Context.synchronize()
    if _pool.cache_info().currsize:
        _pool().stop_holding()
    release_thread()
    _context = None
    # At exit: the streams, events and buffers still referenced (the server's prefiller) are
    # collected after the context is gone, and pycuda warns for each ("... in out-of-thread
    # context could not be cleaned up", 4 lines on every stop of `serve` on the H200); the
    # driver frees the process's device memory as it exits.
    warnings.filterwarnings("ignore", message=".*out-of-thread context could not be cleaned up",
                            category=UserWarning)


def gpuarray():
    driver()
    import pycuda.gpuarray as gpuarray

    return gpuarray


@functools.lru_cache(maxsize=None)
def _pool():
    """Device memory reused across calls: a cudaMalloc per op call costs tens of microseconds,
    as much as a norm kernel at prefill size."""
    driver()
    import pycuda.tools

    return pycuda.tools.DeviceMemoryPool()


def empty(shape: tuple, dtype=np.float32):
    """An uninitialised device array from the pool (scratch and outputs)."""
    return gpuarray().empty(shape, dtype, allocator=_pool().allocate)


@contextmanager
def check(what: str, rendered: ptx.Rendered | None = None, log: list[str] | None = None):
    """Turn a driver error inside the block into a FermijitError naming the kernel and its
    parameters; print the PTX with line numbers (and the JIT log) to stderr so it can be read."""
    import pycuda.driver as cuda

    try:
        yield
    except cuda.Error as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _failure(what, msg, rendered, log) from e


# Modules per context, then per (template, parameters): PTX is JIT-compiled once per context.
_modules: dict[tuple, object] = {}
# Seconds spent loading modules (the driver's JIT or its cache; pycuda holds the GIL meanwhile):
# the server's start shows them (`--verbose`, issue 28 item 4).
module_load_s = 0.0

_PTX_TO_STRUCT = {"u64": "P", "s64": "q", "b64": "Q", "u32": "I", "s32": "i", "b32": "I",
                  "f32": "f"}


class Kernel:
    """One `.entry` of a rendered template, loaded into the current context; launch arguments
    are prepared once from the entry's PTX parameter list (tinygrad's `CUDAProgram`)."""

    def __init__(self, rendered: ptx.Rendered, entry: str):
        cuda = driver()
        if entry not in rendered.entries:
            raise FermijitError(f"{rendered.label} has no entry {entry!r}; it has "
                                f"{sorted(rendered.entries)}")
        self.rendered = rendered
        self.entry = rendered.entries[entry]
        key = (_context_key(cuda), rendered.template, rendered.params, launch_way())
        if key not in _modules:
            start = time.perf_counter()
            if key[-1] == "driver":
                _modules[key] = _DriverModule.load(rendered)
            else:
                log: list[str] = []

                def jit_log(ok: bool, info: str, error: str) -> None:
                    log.extend(s.strip() for s in (info, error) if s and s.strip())

                with check("loading the module (driver JIT)", rendered, log):
                    _modules[key] = cuda.module_from_buffer(rendered.text.encode(),
                                                            message_handler=jit_log)
            global module_load_s  # noqa: PLW0603
            module_load_s += time.perf_counter() - start
        self.arg_format = "".join(_PTX_TO_STRUCT[t] for t in self.entry.param_types)
        module = _modules[key]
        if isinstance(module, _DriverModule):
            self.function, self.handle = None, module.function(entry, rendered)
        else:
            with check(f"getting {entry}", rendered):
                self.function = module.get_function(entry)
            self.function.prepare(self.arg_format)
            self.handle = None

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], *args,
                 stream=None) -> None:
        e, label = self.entry, self.rendered.label
        if len(args) != len(e.param_types):
            raise FermijitError(f"{label}: {e.name} takes {len(e.param_types)} arguments "
                                f"({', '.join(e.param_names)}), got {len(args)}")
        values = [_argument(label, n, t, a) for n, t, a in zip(e.param_names, e.param_types, args)]
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        threads = block[0] * block[1] * block[2]
        if not 0 < threads <= e.max_threads:
            raise FermijitError(f"{label}: block {block} is {threads} threads; .maxntid allows "
                                f"{e.max_threads}")
        if any(not 0 < g <= m for g, m in zip(grid, FERMI_MAX_GRID)):
            raise FermijitError(f"{label}: grid {grid} exceeds Fermi's {FERMI_MAX_GRID}")
        if self.handle is not None:
            _launch(self.handle, grid, block, stream, struct.pack(self.arg_format, *values),
                    f"launching {e.name} grid={grid} block={block}", self.rendered)
            return
        with check(f"launching {e.name} grid={grid} block={block}", self.rendered):
            self.function.prepared_async_call(grid[:2] if grid[2] == 1 else grid, block, stream,
                                              *values)


# --- the driver API's module loads and launches (issue 28 item 4) --------------------------------
# pycuda's module_from_buffer keeps the GIL for the whole cuModuleLoadDataEx (the driver's JIT, or
# its cache): the GPU's start, on a thread beside the CPU kernels' warm-up, held the GIL through
# every module of its 2-token pass. "driver" (the default) loads modules through ctypes.CDLL (the
# GIL released for the load) and launches through ctypes.PyDLL's cuLaunchKernel with the
# arguments packed as pycuda packs them (struct's native alignment, CU_LAUNCH_PARAM_BUFFER_*),
# keeping the GIL (a launch is microseconds; retaking the GIL costs up to the switch interval);
# FERMIJIT_GPU_LAUNCH=pycuda: pycuda's own, as before. The memory and streams stay pycuda's.
LAUNCH_ENV = "FERMIJIT_GPU_LAUNCH"
LAUNCH_WAYS = ("driver", "pycuda")
_JIT_LOG_BYTES = 16 << 10
# cuda.h: CUjit_option, cuLaunchKernel's `extra` keys, cuMemHostAlloc's flags
_JIT_INFO_LOG_BUFFER, _JIT_INFO_LOG_BUFFER_SIZE_BYTES = 3, 4
_JIT_ERROR_LOG_BUFFER, _JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 5, 6
_LAUNCH_PARAM_END, _LAUNCH_PARAM_BUFFER_POINTER, _LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2
MEMHOSTALLOC_PORTABLE = 0x01


def launch_way() -> str:
    """How kernels are loaded and launched: FERMIJIT_GPU_LAUNCH (default "driver"), "pycuda"
    where the driver library cannot be opened through ctypes."""
    way = os.environ.get(LAUNCH_ENV, "driver")
    if way not in LAUNCH_WAYS:
        raise FermijitError(f"{LAUNCH_ENV} must be one of {', '.join(LAUNCH_WAYS)}, got {way!r}")
    if way == "driver":
        try:
            _libcuda(), _libcuda_launch()
        except (OSError, AttributeError):
            return "pycuda"
    return way


def _error_text(call: str, rc: int) -> str:
    """"call failed: the driver's description" (pycuda's wording for its errors)."""
    text = ctypes.c_char_p()
    try:
        if _libcuda().cuGetErrorString(rc, ctypes.byref(text)) == 0 and text.value:
            return f"{call} failed: {text.value.decode(errors='replace')}"
    except (OSError, AttributeError):
        pass
    return f"{call} failed: CUDA error {rc}"


def driver_error(what: str, call: str, rc: int, rendered: ptx.Rendered | None = None,
                 log: list[str] | None = None) -> FermijitError:
    """The FermijitError `check` makes of a pycuda error, for a driver call through ctypes that
    returned `rc` (the PTX and the JIT log on stderr as there)."""
    return _failure(what, _error_text(call, rc), rendered, log)


def _failure(what: str, msg: str, rendered: ptx.Rendered | None, log: list[str] | None):
    """The one-line FermijitError of a failed GPU call; the PTX with line numbers and the JIT
    log on stderr, where a module was being loaded, so they can be read."""
    detail = " ".join(log or [])
    if rendered is not None:
        print(f"--- {rendered.label} ---\n{ptx.numbered(rendered.text)}", file=sys.stderr)
        if detail:
            print(detail, file=sys.stderr)
    where = rendered.label if rendered is not None else "GPU"
    return FermijitError(f"{where}: {what} failed: {msg} {detail}".strip())


class _DriverModule:
    """A CUmodule loaded through ctypes (never unloaded: it lives as long as the context)."""

    def __init__(self, handle: int):
        self.handle = handle
        self.functions: dict[str, int] = {}

    @classmethod
    def load(cls, rendered: ptx.Rendered) -> "_DriverModule":
        """cuModuleLoadDataEx of the rendered PTX (NUL-terminated), with the JIT's logs; the GIL
        is released meanwhile (ctypes.CDLL)."""
        image = ctypes.create_string_buffer(rendered.text.encode())
        info = ctypes.create_string_buffer(_JIT_LOG_BYTES)
        error = ctypes.create_string_buffer(_JIT_LOG_BYTES)
        options = (ctypes.c_int * 4)(_JIT_INFO_LOG_BUFFER, _JIT_INFO_LOG_BUFFER_SIZE_BYTES,
                                     _JIT_ERROR_LOG_BUFFER, _JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        values = (ctypes.c_void_p * 4)(ctypes.addressof(info), _JIT_LOG_BYTES,
                                       ctypes.addressof(error), _JIT_LOG_BYTES)
        handle = ctypes.c_void_p()
        rc = _libcuda().cuModuleLoadDataEx(ctypes.byref(handle), image, 4, options, values)
        if rc != 0:
            log = [b.value.decode(errors="replace").strip() for b in (info, error)]
            raise driver_error("loading the module (driver JIT)", "cuModuleLoadDataEx", rc,
                               rendered, [t for t in log if t])
        return cls(handle.value)

    def function(self, entry: str, rendered: ptx.Rendered) -> int:
        """The CUfunction of `entry`."""
        if entry not in self.functions:
            handle = ctypes.c_void_p()
            rc = _libcuda().cuModuleGetFunction(ctypes.byref(handle), ctypes.c_void_p(self.handle),
                                                entry.encode())
            if rc != 0:
                raise driver_error(f"getting {entry}", "cuModuleGetFunction", rc, rendered)
            self.functions[entry] = handle.value
        return self.functions[entry]


def _launch(function: int, grid: tuple, block: tuple, stream, packed: bytes, what: str,
            rendered: ptx.Rendered) -> None:
    """cuLaunchKernel of `function` with its arguments packed in one buffer (as pycuda's
    prepared calls pass them), on `stream` (a pycuda Stream; None: the legacy default stream),
    keeping the GIL."""
    buf = ctypes.create_string_buffer(packed, len(packed))
    size = ctypes.c_size_t(len(packed))
    extra = (ctypes.c_void_p * 5)(_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buf),
                                  _LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size),
                                  _LAUNCH_PARAM_END)
    rc = _libcuda_launch().cuLaunchKernel(function, *grid, *block, 0,
                                          stream.handle if stream is not None else None,
                                          None, extra)
    if rc != 0:
        raise driver_error(what, "cuLaunchKernel", rc, rendered)


@functools.lru_cache(maxsize=None)
def _libcuda_launch():
    """cuLaunchKernel through ctypes.PyDLL: the GIL kept (`_launch`)."""
    lib = ctypes.PyDLL("libcuda.so.1")
    lib.cuLaunchKernel.argtypes = DRIVER_ARGTYPES["cuLaunchKernel"]
    lib.cuLaunchKernel.restype = ctypes.c_int
    return lib


def _context_key(cuda) -> int:
    current = cuda.Context.get_current()
    return getattr(current, "handle", id(current))


def _argument(label: str, name: str, ptx_type: str, value):
    """A launch argument as the prepared format wants it: device arrays become pointers."""
    if ptx_type == "u64":
        if is_device(value):
            if not value.flags.c_contiguous:
                raise FermijitError(f"{label}: {name} must be a contiguous device array")
            return int(value.gpudata)
        if value is None:
            return 0  # a pointer this variant does not read
        if isinstance(value, (int, np.integer)) or type(value).__name__ == "DeviceAllocation":
            return int(value)
        raise FermijitError(f"{label}: {name} must be a device array, got {type(value).__name__}")
    if ptx_type == "f32":
        return float(value)
    if isinstance(value, (bool, float, np.floating)) or not isinstance(value, (int, np.integer)):
        raise FermijitError(f"{label}: {name} must be an integer, got {value!r}")
    bits = 64 if ptx_type.endswith("64") else 32
    if ptx_type[0] == "s":
        low, high = -(1 << bits - 1), (1 << bits - 1) - 1
    else:
        low, high = 0, (1 << bits) - 1
    if not low <= int(value) <= high:
        raise FermijitError(f"{label}: {name}={value} does not fit .{ptx_type}")
    return int(value)


@functools.lru_cache(maxsize=None)
def _kernel(template: str, entry: str, params: tuple, context_key: int) -> Kernel:
    return Kernel(ptx.render(template, **dict(params)), entry)


def kernel(template: str, entry: str | None = None, **params) -> Kernel:
    """The loaded kernel `entry` (default: the template's only entry) of `template(**params)`."""
    cuda = driver()
    rendered = ptx.render(template, **params)
    if entry is None:
        if len(rendered.entries) != 1:
            raise FermijitError(f"{rendered.label} has entries {sorted(rendered.entries)}; "
                                "name one")
        entry = next(iter(rendered.entries))
    return _kernel(template, entry, tuple(sorted(params.items())), _context_key(cuda))


# --- arrays -------------------------------------------------------------------------------------

def is_device(a) -> bool:
    return hasattr(a, "gpudata")


def check_array(op: str, name: str, a, dtype, shape: tuple | None = None,
                ndim: int | None = None):
    """`checks.check_array` for a numpy or a device array (no copy); returns `a`."""
    if not is_device(a):
        return checks.check_array(op, name, a, dtype, shape, ndim)
    if a.dtype != np.dtype(dtype):
        raise FermijitError(f"{op}: {name} has dtype {a.dtype}, expected {np.dtype(dtype)}")
    if shape is not None:
        if len(a.shape) != len(shape) or any(s is not None and s != n
                                             for s, n in zip(shape, a.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise FermijitError(f"{op}: {name} has shape {list(a.shape)}, expected {want}")
    if ndim is not None and len(a.shape) != ndim:
        raise FermijitError(f"{op}: {name} must be {ndim}-D, got shape {list(a.shape)}")
    if not a.flags.c_contiguous:
        raise FermijitError(f"{op}: {name} must be a C-contiguous device array")
    return a


def to_device(op: str, name: str, a, dtype, shape: tuple | None = None, ndim: int | None = None):
    """`a` checked (`check_array`) and on the device: a device array as it is, numpy copied in."""
    check_array(op, name, a, dtype, shape, ndim)
    if is_device(a):
        return a
    ga = gpuarray()
    with check(f"{op}: copying {name} to the device"):
        return ga.to_gpu(a, allocator=_pool().allocate)


# Bytes: where each array of `upload` starts in its allocation (what a cuMemAlloc of its own
# gave it).
UPLOAD_ALIGN = 256
# Bytes: a pageable array at most this big is queued like a page-locked one (the driver stages it
# on the spot: microseconds); a bigger one goes through pycuda's memcpy_htod, which releases the
# GIL for the copy.
QUEUE_PAGEABLE_MAX = 1 << 20


def upload(op: str, arrays: list[np.ndarray]) -> list:
    """Host arrays (C-contiguous) on the device as views of ONE allocation, each from an
    UPLOAD_ALIGN-byte offset, in the order given: the GPU prefill's dense weights (~800 arrays,
    ~1.5 GB at full size). The copies go on a copy stream through `_queue_htod`, which keeps the
    GIL (page-locked sources, the registered model file's pages, and small pageable ones), or
    through memcpy_htod (larger pageable ones: the driver stages them, the GIL released), and are
    awaited once. (An allocation and a pycuda copy per array, each releasing and retaking the GIL,
    took 0.72-0.96 s of the server's start on the H200's host, with the CPU kernels' warm-up on
    another thread waiting for the GIL as often: issue 28 item 4.)"""
    cuda = driver()
    sizes = [int(a.nbytes) for a in arrays]
    offsets = np.cumsum([0] + [-(-n // UPLOAD_ALIGN) * UPLOAD_ALIGN for n in sizes])
    ga = gpuarray()
    with check(f"{op}: allocating {int(offsets[-1])} bytes"):
        block = cuda.mem_alloc(max(int(offsets[-1]), 1))
    base = int(block)
    out = [ga.GPUArray(a.shape, a.dtype, gpudata=base + int(at), base=block)
           for a, at in zip(arrays, offsets)]
    locked = [is_page_locked(a) for a in arrays]
    stream = copy_stream()
    # Pageable ones first: an async copy from pageable memory waits for the stream's work before.
    order = sorted(range(len(arrays)), key=lambda n: locked[n])
    bounds = registered_bounds()
    with check(f"{op}: copying {len(arrays)} arrays to the device"):
        for n in order:
            a = arrays[n]
            if not a.flags.c_contiguous:
                raise FermijitError(f"{op}: array {n} is not C-contiguous")
            if not a.nbytes:
                continue
            if locked[n]:
                for at, piece in split_at_registrations(a, bounds):
                    _queue_htod(base + int(offsets[n]) + at, piece, stream)
            elif a.nbytes <= QUEUE_PAGEABLE_MAX:
                _queue_htod(base + int(offsets[n]), a, stream)
            else:
                cuda.memcpy_htod(base + int(offsets[n]), a)
        stream.synchronize()
    return out


def _queue_htod(address: int, host: np.ndarray, stream) -> None:
    """cuMemcpyHtoDAsync of `host` to `address` on `stream`, called through ctypes.PyDLL: queued
    without releasing the GIL (pycuda's memcpy_htod_async releases and retakes it, and retaking it
    waits up to the switch interval, 5 ms, while another thread runs Python)."""
    rc = _libcuda_holding_gil().cuMemcpyHtoDAsync_v2(
        ctypes.c_uint64(address), ctypes.c_void_p(host.ctypes.data), ctypes.c_size_t(host.nbytes),
        ctypes.c_void_p(stream.handle))
    if rc != 0:
        raise FermijitError(f"copying {host.nbytes} bytes to the device failed: CUDA error {rc}")


def is_page_locked(a: np.ndarray) -> bool:
    """Whether host array `a` lies in page-locked memory: a `pinned` buffer or `register`ed
    ranges (the model file's pages, registered in chunks: it may span several)."""
    if is_pinned(a):
        return True
    at, end = a.ctypes.data, a.ctypes.data + a.nbytes
    for start, n in sorted(_registered.keys()):
        if start <= at < start + n:
            at = start + n
        if at >= end:
            return True
    return False


def registered_bounds() -> list[int]:
    """The addresses where registered ranges begin or end, sorted (`split_at_registrations`)."""
    return sorted({x for start, n in list(_registered.keys()) for x in (start, start + n)})


def split_at_registrations(host: np.ndarray,
                           bounds: list[int] | None = None) -> list[tuple[int, np.ndarray]]:
    """(byte offset, uint8 view) pieces of contiguous `host` cut where a registered range begins
    or ends inside it (`bounds`: registered_bounds(), default now), or [(0, host)] where none
    does: one copy must read from one registration (a copy from a range that only starts inside
    one fails), and the model file is registered in chunks (gpu_early.REGISTER_CHUNK_BYTES).
    On the expert streamer's path per copy: ~1 us uncut."""
    at = host.__array_interface__["data"][0]
    end = at + host.nbytes
    bounds = registered_bounds() if bounds is None else bounds
    cuts = bounds[bisect.bisect_right(bounds, at):bisect.bisect_left(bounds, end)]
    if not cuts:
        return [(0, host)]
    flat = host.reshape(-1).view(np.uint8)
    bounds = [at, *cuts, end]
    return [(lo - at, flat[lo - at:hi - at]) for lo, hi in zip(bounds, bounds[1:])]


def output(op: str, out, shape: tuple, dtype=np.float32):
    """The device array a kernel writes: `out` itself when it is on the device, else a new one
    (checked against a numpy `out` first, so a bad `out` fails before any launch)."""
    if out is None or not is_device(out):
        if out is not None:
            checks.output(op, out, shape, dtype)
        with check(f"{op}: allocating the output"):
            return empty(shape, dtype)
    return to_device(op, "out", out, dtype, shape)


def result(op: str, device_out, out, on_device: bool):
    """What `gpu(...)` returns: the device array when the caller works on the device, else the
    values copied into `out` (or a new numpy array). The copy waits for the kernels, so a fault
    in one of them surfaces here, named."""
    if on_device:
        return device_out
    host = out if out is not None else np.empty(device_out.shape, device_out.dtype)
    with check(f"{op}: running kernels and copying the result back"):
        device_out.get(host)
    return host


# --- streams, events, page-locked memory (issue 10: experts streamed from host RAM) ------------

NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit sync with the legacy stream the ops use


def copy_stream():
    """A stream for host-to-device copies that overlap the kernels: the ops launch on the legacy
    default stream, which a plain stream would synchronise with (CUDA's legacy semantics)."""
    cuda = driver()
    with check("creating a copy stream"):
        return cuda.Stream(flags=NON_BLOCKING)


def event():
    cuda = driver()
    with check("creating an event"):
        return cuda.Event()


def pinned(nbytes: int) -> np.ndarray:
    """`nbytes` of page-locked host memory (uint8): the DMA engine reads it directly, so copies
    from it run at the link's rate and asynchronously (about 55 GB/s against 9 GB/s pageable on
    the H200, shared/device/README.md)."""
    cuda = driver()
    if launch_way() == "driver":
        buf = np.asarray(_HostAllocation(int(nbytes)))
    else:
        with check(f"page-locking {nbytes} bytes of host memory"):
            buf = cuda.pagelocked_empty(int(nbytes), np.uint8)
    _pinned[buf.ctypes.data] = buf.nbytes
    weakref.finalize(buf, _pinned.pop, buf.ctypes.data, None)
    return buf


class _HostAllocation:
    """cuMemHostAlloc's page-locked bytes through ctypes.CDLL: the GIL released while the driver
    allocates and locks them (pycuda's pagelocked_empty keeps it: the server's hand-off room and
    GDN pool, ~1 GB at full size, are made beside the CPU kernels' warm-up). A numpy array over
    it keeps it (its base); freed with it."""

    def __init__(self, nbytes: int):
        address = ctypes.c_void_p()
        rc = _libcuda().cuMemHostAlloc(ctypes.byref(address), max(1, nbytes),
                                       MEMHOSTALLOC_PORTABLE)
        if rc != 0:
            raise driver_error(f"page-locking {nbytes} bytes of host memory", "cuMemHostAlloc",
                               rc)
        self.address = address.value
        self.__array_interface__ = {"data": (self.address, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def __del__(self):
        context = _context
        if context is None:  # the process is ending: the context went first, and its memory
            return
        try:
            lib = _libcuda()
            # The context current for the free, whatever thread drops the last reference.
            if lib.cuCtxPushCurrent_v2(ctypes.c_void_p(context.handle)) == 0:
                lib.cuMemFreeHost(ctypes.c_void_p(self.address))
                lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        except Exception:  # noqa: BLE001 - at the interpreter's end its modules may be gone
            pass


_pinned: dict[int, int] = {}  # address -> bytes of each live `pinned` buffer


def is_pinned(a: np.ndarray) -> bool:
    """Whether the host array `a` lies in a `pinned` buffer (a copy into it runs as DMA)."""
    at, root = a.ctypes.data, a
    while isinstance(root.base, np.ndarray):  # a view's buffer first: one lookup, not a scan
        root = root.base
    start, n = root.ctypes.data, _pinned.get(root.ctypes.data)
    if n is not None and start <= at and at + a.nbytes <= start + n:
        return True
    return any(start <= at and at + a.nbytes <= start + n for start, n in list(_pinned.items()))


def memory() -> tuple[int, int]:
    """(free, total) bytes of device memory."""
    cuda = driver()
    with check("querying device memory"):
        free, total = cuda.mem_get_info()
    return int(free), int(total)


def copy_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> None:
    """Device-to-device copy of `height` rows of `width` bytes between pitched layouts (byte
    addresses), on the legacy stream: how prefill splits interleaved heads without a kernel."""
    cuda = driver()
    copy = cuda.Memcpy2D()
    copy.set_src_device(int(src))
    copy.set_dst_device(int(dst))
    copy.src_pitch, copy.dst_pitch = int(src_pitch), int(dst_pitch)
    copy.width_in_bytes, copy.height = int(width), int(height)
    with check("a pitched device copy"):
        copy(aligned=False)




class Registered:
    """Host memory page-locked in place (cuMemHostRegister): copies from it run as DMA, as from
    `pinned` memory, without a second copy of the bytes. Unregistered when dropped."""

    def __init__(self, address: int, nbytes: int):
        self.address, self.nbytes = address, nbytes

    def __del__(self):
        if _context is not None:
            _libcuda().cuMemHostUnregister(ctypes.c_void_p(self.address))


_registered: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(address: int, nbytes: int) -> Registered | None:
    """`nbytes` at `address` (page-aligned, mapped read-only or not) page-locked for the device,
    or None where the driver refuses (no read-only registration, RLIMIT_MEMLOCK, memory). A
    range registered already (a second prefiller on the same model) is shared; one registered
    at exec (serve: gpu_early, the same chunks of the same mapping) is adopted."""
    driver()
    held = _registered.get((address, nbytes))
    if held is not None:
        return held
    if not gpu_early.take_registration(address, nbytes):
        rc = _libcuda().cuMemHostRegister_v2(ctypes.c_void_p(address), ctypes.c_size_t(nbytes),
                                             REGISTER_PORTABLE | REGISTER_READ_ONLY)
        if rc != 0:
            return None
    held = _registered[(address, nbytes)] = Registered(address, nbytes)
    return held


@functools.lru_cache(maxsize=None)
def _libcuda_holding_gil():
    """The driver API through ctypes.PyDLL: its calls keep the GIL (`_queue_htod`)."""
    lib = ctypes.PyDLL("libcuda.so.1")
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_void_p]
    lib.cuMemcpyHtoDAsync_v2.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=None)
def _libcuda():
    """The driver API through ctypes, for what pycuda does not wrap with flags (register), and
    the driver-API way's module loads and page-locking (`launch_way`)."""
    lib = ctypes.CDLL("libcuda.so.1")
    for name, argtypes in DRIVER_ARGTYPES.items():
        if name != "cuLaunchKernel" and hasattr(lib, name):  # an older driver: what it has
            getattr(lib, name).argtypes = argtypes
    return lib


# The driver calls made through ctypes, and their argument types (cuda.h); all return CUresult.
DRIVER_ARGTYPES = {
    "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [ctypes.c_void_p],
    "cuModuleLoadDataEx": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_uint,
                           ctypes.c_void_p, ctypes.c_void_p],
    "cuModuleGetFunction": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuMemHostAlloc": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint],
    "cuMemFreeHost": [ctypes.c_void_p],
    "cuCtxPushCurrent_v2": [ctypes.c_void_p],
    "cuCtxPopCurrent_v2": [ctypes.POINTER(ctypes.c_void_p)],
    "cuLaunchKernel": [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3,
}
