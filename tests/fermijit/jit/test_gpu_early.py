"""fermijit/jit/gpu_early.py: serve's model file mapped and registered with the driver from exec
(issue 28 item 4). With a stand-in driver (everywhere): the loader takes the early mapping (the
same addresses), gpu.register adopts the early chunks (no chunk registered twice), what is not
adopted is unregistered, and a missing driver, a refusal or a changed file leave the normal path
as it was. On a GPU (skipped without one): the real driver's registrations are the ones the
expert streamer then holds."""

import gc
import mmap
import os
import threading
import weakref

import numpy as np
import pytest

from fermijit.jit import gpu, gpu_early
from fermijit.model.safetensors_io import SafetensorsFile, save_file
from fermijit.prefill import expert_stream
from tests import gpu as gpu_marks

PAGE = mmap.PAGESIZE


class FakeLib:
    """The driver calls gpu_early and gpu.register make, as Python functions: which thread
    registered what, what was unregistered; `refuse_at`: the n-th registration fails."""

    def __init__(self, refuse_at: int | None = None):
        self.refuse_at, self.lock = refuse_at, threading.Lock()
        self.registered, self.unregistered, self.current = [], [], {}

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, device, ordinal):
        device._obj.value = 0
        return 0

    def cuDevicePrimaryCtxRetain(self, context, device):
        context._obj.value = 0xC0
        return 0

    def cuCtxSetCurrent(self, context):
        self.current[threading.get_ident()] = context
        return 0

    def cuCtxPushCurrent_v2(self, context):
        return self.cuCtxSetCurrent(context)

    def cuCtxPopCurrent_v2(self, context):
        return 0

    def cuMemHostRegister_v2(self, address, nbytes, flags):
        assert flags == gpu_early.REGISTER_PORTABLE | gpu_early.REGISTER_READ_ONLY
        with self.lock:
            if self.refuse_at is not None and len(self.registered) == self.refuse_at:
                return 1
            self.registered.append((address.value, nbytes.value,
                                    threading.current_thread().name))
        return 0

    def cuMemHostUnregister(self, address):
        self.unregistered.append(address.value)
        return 0


@pytest.fixture
def weights(tmp_path, rng):
    """A safetensors file of ~20 pages whose data starts off a page boundary."""
    path = tmp_path / "model.safetensors"
    save_file(path, {"a.qs": rng.integers(0, 256, (8, 5 * PAGE + 100), dtype=np.uint8),
                     "b.d": rng.standard_normal((3, 777)).astype(np.float16)})
    return path


@pytest.fixture
def early(monkeypatch):
    """gpu_early's state fresh, chunks of 2 pages, 3 threads; gpu.register's driver the same
    stand-in (so a chunk registered by the normal path shows as one more call)."""
    monkeypatch.setattr(gpu_early, "_start", None)
    monkeypatch.setenv(gpu_early.REGISTER_CHUNK_ENV, str(2 * PAGE / (1 << 20)))
    monkeypatch.setenv(gpu_early.REGISTER_THREADS_ENV, "3")
    monkeypatch.setattr(gpu, "_registered", weakref.WeakValueDictionary())
    monkeypatch.setattr(gpu, "driver", lambda: None)

    def use(lib):
        monkeypatch.setattr(gpu_early, "_load_driver", lambda: lib)
        monkeypatch.setattr(gpu, "_libcuda", lambda: lib)
        return lib

    return use


def started(plan) -> None:
    gpu_early.start(plan)
    gpu_early._start.finished.wait(10)


def test_the_loader_takes_the_early_mapping_and_the_streamer_adopts_its_chunks(early, weights,
                                                                             monkeypatch):
    lib = early(FakeLib())
    started(lambda: (weights, None, None))
    f = SafetensorsFile(weights)
    data = f.mapped()
    mapping = gpu_early._start.mapping
    assert isinstance(data, np.memmap) and data._mmap is mapping.mm
    assert data.ctypes.data == mapping.address and not data.flags.writeable
    fresh = np.memmap(weights, np.uint8, "r", offset=f.data_start)
    np.testing.assert_array_equal(data, fresh)
    f.populate()  # the loader's pre-faulting takes it as its own map
    early_chunks = sorted((a, n) for a, n, _ in lib.registered)
    assert all(name.startswith("fermijit-early-register-") for *_, name in lib.registered)
    assert len(early_chunks) == len(set(early_chunks)) > 5

    held = expert_stream._register_in_place([(f.raw("a.qs"), f.raw("b.d"))])
    assert sorted((r.address, r.nbytes) for r in held) == early_chunks
    assert len(lib.registered) == len(early_chunks)  # none registered twice
    assert gpu.is_page_locked(f.raw("a.qs")) and gpu.is_page_locked(data)
    assert gpu_early.registration()["adopted"] == len(early_chunks)
    gpu_early.release()
    assert lib.unregistered == []  # all adopted: they are the streamer's
    monkeypatch.setattr(gpu, "_context", object())  # Registered lets go through the driver
    del held
    gc.collect()
    assert sorted(lib.unregistered) == [a for a, _ in early_chunks]


def test_what_is_not_adopted_is_unregistered_and_the_mapping_still_serves(early, weights):
    lib = early(FakeLib())
    started(lambda: (weights, None, None))
    data = SafetensorsFile(weights).mapped()
    gpu_early.release()
    assert sorted(lib.unregistered) == sorted(a for a, _, _ in lib.registered)
    assert gpu_early._start.mapping is None and data[:10].tolist() == data[:10].tolist()
    assert not gpu_early.take_registration(*lib.registered[0][:2])


def test_no_driver_the_mapping_is_handed_on_and_nothing_registered(early, monkeypatch, weights):
    lib = early(FakeLib())

    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(gpu_early, "_load_driver", missing)
    started(lambda: (weights, None, None))
    data = SafetensorsFile(weights).mapped()
    assert data._mmap is gpu_early._start.mapping.mm
    assert gpu_early.registration() is None
    held = expert_stream._register_in_place([(data,)])  # the normal path registers, as before
    assert len(held) == len(lib.registered) and all(name == threading.current_thread().name
                                                    or name.startswith("fermijit-register-")
                                                    for *_, name in lib.registered)


def test_a_refusal_unregisters_the_early_chunks_and_the_normal_path_runs_as_before(early,
                                                                                   weights):
    lib = early(FakeLib(refuse_at=3))
    started(lambda: (weights, None, None))
    assert len(lib.unregistered) == 3 and not gpu_early._start.registered
    lib.refuse_at = None
    f = SafetensorsFile(weights)
    held = expert_stream._register_in_place([(f.mapped(),)])
    assert held is not None and gpu_early.registration()["adopted"] == 0
    assert len(lib.registered) == 3 + len(held)


def test_a_file_too_large_for_the_pin_budget_is_mapped_not_registered(early, weights):
    lib = early(FakeLib())
    started(lambda: (weights, 1000, None))
    assert SafetensorsFile(weights).mapped()._mmap is gpu_early._start.mapping.mm
    assert lib.registered == [] and gpu_early.registration() is None


def test_a_file_replaced_after_the_early_mapping_is_mapped_again(early, weights, tmp_path):
    lib = early(FakeLib())
    started(lambda: (weights, None, None))
    other = tmp_path / "other.safetensors"
    save_file(other, {"x": np.arange(10, dtype=np.float32)})
    os.replace(other, weights)
    f = SafetensorsFile(weights)
    assert f.mapped()._mmap is not gpu_early._start.mapping.mm
    np.testing.assert_array_equal(f.raw("x"), np.arange(10, dtype=np.float32))
    gpu_early.release()
    assert sorted(lib.unregistered) == sorted(a for a, _, _ in lib.registered)


def test_each_registering_thread_is_placed_first(early, weights):
    early(FakeLib())
    placed = []
    started(lambda: (weights, None, lambda address, nbytes: placed.append(
        (threading.current_thread().name, address, nbytes))))
    mapping = gpu_early._start.mapping
    assert sorted(placed) == [(f"fermijit-early-register-{n}", mapping.address,
                               mapping.data_nbytes) for n in range(3)]


def test_a_plan_that_fails_leaves_the_loader_to_map(early, weights):
    early(FakeLib())

    def broken():
        raise ValueError("no")

    started(broken)
    assert gpu_early._start.mapping is None
    assert SafetensorsFile(weights).mapped()[:4].size == 4
    gpu_early.release()


@gpu_marks.needs_gpu
def test_the_driver_s_early_registrations_are_the_ones_the_streamer_holds(monkeypatch, tmp_path,
                                                                          rng):
    """On the device: the early thread registers a 40 MiB file in 4 MiB chunks; the loader's
    mapping is at those addresses; _register_in_place adopts every chunk (a second registration
    of a registered range would be refused: held would be None); the bounds cover the file; a
    copy across a chunk's end comes back whole; once dropped they can be registered again."""
    import pycuda.driver as cuda

    if cuda.get_driver_version() < 11010:
        pytest.skip("the driver cannot register read-only memory")
    monkeypatch.setattr(gpu_early, "_start", None)
    monkeypatch.setenv(gpu_early.REGISTER_CHUNK_ENV, "4")
    path = tmp_path / "model.safetensors"
    save_file(path, {"experts.qs": rng.integers(0, 256, (10, 4 << 20), dtype=np.uint8)})
    started(lambda: (path, None, None))
    f = SafetensorsFile(path)
    data = f.mapped()
    assert data._mmap is gpu_early._start.mapping.mm
    n_chunks = gpu_early.registration()["chunks"]
    assert n_chunks == -(-(data.ctypes.data % PAGE + data.nbytes) // (4 << 20)) >= 10
    held = expert_stream._register_in_place([(f.raw("experts.qs"),)])
    assert held is not None and len(held) == n_chunks
    assert gpu_early.registration()["adopted"] == n_chunks
    first = data.ctypes.data // PAGE * PAGE
    last = -(-(data.ctypes.data + data.nbytes) // PAGE) * PAGE
    bounds = [b for b in gpu.registered_bounds() if first <= b <= last]
    assert bounds[0] == first and bounds[-1] == last and len(bounds) == n_chunks + 1
    gpu_early.release()
    src = f.raw("experts.qs")[2:4].reshape(-1)  # across a chunk's end
    cuda_ = gpu.driver()
    device = cuda_.mem_alloc(src.nbytes)
    stream = gpu.copy_stream()
    for at, part in gpu.split_at_registrations(src):
        cuda_.memcpy_htod_async(int(device) + at, part, stream)
    stream.synchronize()
    back = np.empty_like(src)
    cuda_.memcpy_dtoh(back, device)
    np.testing.assert_array_equal(back, src)
    del held
    gc.collect()
    again = expert_stream._register_in_place([(f.raw("experts.qs"),)])
    assert again is not None and len(again) == n_chunks
