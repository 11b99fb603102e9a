"""fermijit/jit/gpu.py's driver-API way of loading modules, launching kernels and page-locking
host memory (FERMIJIT_GPU_LAUNCH=driver, the default; issue 28 item 4: pycuda keeps the GIL
through every module load and page-locking, which the server's GPU start does on a thread beside
the CPU kernels' warm-up). Stand-in tests of what goes to the driver run everywhere; the GPU
tests (skipped without one) check the two ways against each other on a device."""

import ctypes
import struct
import threading
import time

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.jit import gpu, ptx
from tests import gpu as gpu_marks


class FakeDriver:
    """libcuda's calls the driver way makes, as C functions (ctypes callbacks with the argument
    types gpu.DRIVER_ARGTYPES gives the library): what the calls pass goes through ctypes'
    conversions as it would to the driver."""

    def __init__(self, load_rc: int = 0):
        self.load_rc, self.loads, self.launches, self.functions = load_rc, [], [], []
        self.allocations, self.freed, self.pushed = {}, [], []
        self._callbacks = []  # kept alive
        for name, argtypes in gpu.DRIVER_ARGTYPES.items():
            c = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(getattr(self, "_" + name))
            self._callbacks.append(c)
            setattr(self, name, c)

    def _cuModuleLoadDataEx(self, handle, image, n, options, values):
        self.loads.append(image)
        keys = (ctypes.c_int * n).from_address(options)
        vals = (ctypes.c_void_p * n).from_address(values)
        assert list(keys) == [3, 4, 5, 6] and vals[1] == vals[3] == gpu._JIT_LOG_BYTES
        if self.load_rc:
            ctypes.memmove(vals[2], b"ptxas fatal: a stand-in error\0", 30)
            return self.load_rc
        handle[0] = 0x1000 + len(self.loads)
        return 0

    def _cuModuleGetFunction(self, handle, module, name):
        self.functions.append((module, name))
        handle[0] = 0x2000 + len(self.functions)
        return 0

    def _cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        words = (ctypes.c_void_p * 5).from_address(extra)
        assert params is None and words[0] == 1 and words[2] == 2 and words[4] is None
        size = ctypes.c_size_t.from_address(words[3]).value
        self.launches.append((function, (gx, gy, gz), (bx, by, bz), shared, stream,
                              ctypes.string_at(words[1], size)))
        return 0

    def _cuGetErrorString(self, rc, text):
        text[0] = self._error = ctypes.c_char_p(b"a stand-in failure").value
        return 0

    def _cuMemHostAlloc(self, address, nbytes, flags):
        buf = ctypes.create_string_buffer(nbytes)
        address[0] = ctypes.addressof(buf)
        self.allocations[ctypes.addressof(buf)] = (buf, flags)
        return 0

    def _cuMemFreeHost(self, address):
        self.freed.append(address)
        return 0

    def _cuCtxPushCurrent_v2(self, context):
        self.pushed.append(context)
        return 0

    def _cuCtxPopCurrent_v2(self, context):
        context[0] = self.pushed.pop()
        return 0

    def _cuMemHostRegister_v2(self, address, nbytes, flags):
        return 1

    def _cuMemHostUnregister(self, address):
        return 0


@pytest.fixture
def fake(monkeypatch):
    import types

    lib = FakeDriver()
    monkeypatch.setenv(gpu.LAUNCH_ENV, "driver")
    monkeypatch.setattr(gpu, "driver", lambda: None)
    monkeypatch.setattr(gpu, "_context_key", lambda cuda: 77)
    monkeypatch.setattr(gpu, "_libcuda", lambda: lib)
    monkeypatch.setattr(gpu, "_libcuda_launch", lambda: lib)
    monkeypatch.setattr(gpu, "_context", types.SimpleNamespace(handle=0xC0))
    monkeypatch.setattr(gpu, "_modules", {})
    return lib


def test_a_launch_passes_the_arguments_packed_as_pycuda_packs_them(fake):
    """The norm kernel's pointers, integers and floats in one buffer at their native alignment
    (struct's "@", what pycuda's prepared calls pass as CU_LAUNCH_PARAM_BUFFER_POINTER); grid and
    block padded to 3-D; the stream's handle; the module loaded once for two kernels of it."""
    rendered = ptx.render("norm", MODE="rms")
    entry = next(iter(rendered.entries))
    kernel = gpu.Kernel(rendered, entry)
    again = gpu.Kernel(rendered, entry)
    assert len(fake.loads) == 1 and fake.loads[0] == rendered.text.encode()
    assert fake.functions == [(0x1001, entry.encode())]
    assert kernel.handle == 0x2001 and again.handle == 0x2001 and kernel.function is None

    class Stream:
        handle = 0x5151

    args = (0x7F0000001000, None, 0x7F0000002000, 0x7F0000003000, 5, 2048, 1e-6, 1.0)
    kernel((5,), (256,), *args, stream=Stream())
    kernel((3, 2), (128, 2), *args)
    (f, grid, block, shared, stream, packed), second = fake.launches
    assert (f, grid, block, shared, stream) == (0x2001, (5, 1, 1), (256, 1, 1), 0, 0x5151)
    assert second[1:5] == ((3, 2, 1), (128, 2, 1), 0, None)  # the legacy default stream
    fmt = "".join(gpu._PTX_TO_STRUCT[t] for t in kernel.entry.param_types)
    assert packed == struct.pack(fmt, *(0 if a is None else a for a in args))
    values = struct.unpack(fmt, packed)
    assert values[:6] == (0x7F0000001000, 0, 0x7F0000002000, 0x7F0000003000, 5, 2048)
    assert values[6] == pytest.approx(1e-6) and values[7] == 1.0
    with pytest.raises(FermijitError, match="takes 8 arguments"):
        kernel((1,), (256,), *args[:-1])


def test_a_failed_module_load_says_the_jit_log_and_the_driver_error(fake, capsys):
    fake.load_rc = 218  # CUDA_ERROR_INVALID_PTX
    rendered = ptx.render("norm", MODE="rms")
    with pytest.raises(FermijitError) as e:
        gpu.Kernel(rendered, next(iter(rendered.entries)))
    text = str(e.value)
    assert "loading the module (driver JIT) failed" in text
    assert "cuModuleLoadDataEx failed: a stand-in failure" in text
    assert "ptxas fatal: a stand-in error" in text
    assert f"--- {rendered.label} ---" in capsys.readouterr().err  # the PTX, numbered


def test_pinned_memory_from_the_driver_is_an_array_over_it_freed_with_it(fake):
    buf = gpu.pinned(4096 + 3)
    address = buf.ctypes.data
    assert buf.dtype == np.uint8 and buf.shape == (4099,) and address in fake.allocations
    assert fake.allocations[address][1] == gpu.MEMHOSTALLOC_PORTABLE
    buf[:] = 7
    view = buf[100:200]
    assert gpu.is_pinned(view) and (view == 7).all()
    del buf
    assert fake.freed == []  # the view keeps it
    del view
    import gc

    gc.collect()
    assert fake.freed == [address] and fake.pushed == []  # freed inside a push and a pop
    assert not gpu.is_pinned(np.zeros(4))


def test_the_launch_way_is_the_environment_s(monkeypatch):
    monkeypatch.setenv(gpu.LAUNCH_ENV, "pycuda")
    assert gpu.launch_way() == "pycuda"
    monkeypatch.setenv(gpu.LAUNCH_ENV, "cupy")
    with pytest.raises(FermijitError, match="FERMIJIT_GPU_LAUNCH must be one of"):
        gpu.launch_way()


# --- on a GPU -----------------------------------------------------------------------------------

@gpu_marks.needs_gpu
def test_both_ways_give_the_same_bits(monkeypatch, rng):
    """rmsnorm and the gated norm through the driver way and through pycuda's: the same bits
    (the same PTX, the same arguments), outputs poisoned with NaN."""
    from fermijit.ops import rmsnorm

    x = rng.standard_normal((37, 96)).astype(np.float32)
    z = rng.standard_normal((37, 4, 24)).astype(np.float32)
    w, wz = rng.standard_normal(96).astype(np.float32), rng.standard_normal(24).astype(np.float32)
    got = {}
    for way in gpu.LAUNCH_WAYS:
        monkeypatch.setenv(gpu.LAUNCH_ENV, way)
        gpu._kernel.cache_clear()
        out, gated = np.full_like(x, np.nan), np.full_like(z, np.nan)
        rmsnorm.gpu(x, w, 1e-6, out=out)
        rmsnorm.gated_gpu(x.reshape(37, 4, 24), z, wz, 1e-6, out=gated)
        got[way] = out, gated
    gpu._kernel.cache_clear()
    for a, b in zip(got["driver"], got["pycuda"]):
        assert not np.isnan(a).any()
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(got["driver"][0], rmsnorm.cpu(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@gpu_marks.needs_gpu
def test_a_module_load_lets_other_threads_run(monkeypatch):
    """Another thread counts while the driver way loads a module (ctypes.CDLL releases the
    GIL); the pages it locks are usable for an asynchronous copy there and back."""
    monkeypatch.setenv(gpu.LAUNCH_ENV, "driver")
    counts, stop = [0], [False]

    def count():
        while not stop[0]:
            counts[0] += 1

    rendered = ptx.render("norm", MODE="l2")
    gpu.driver()
    thread = threading.Thread(target=count)
    thread.start()
    time.sleep(0.05)
    try:
        before = counts[0]
        gpu._DriverModule.load(rendered)
        during = counts[0] - before
    finally:
        stop[0] = True
        thread.join()
    assert during > 0
    host = gpu.pinned(1 << 20)
    host[:] = np.arange(host.size, dtype=np.uint32).view(np.uint8)[:host.size]
    dev = gpu.to_device("test", "x", host, np.uint8)
    back = np.full_like(host, 0)
    dev.get(back)
    np.testing.assert_array_equal(back, host)
