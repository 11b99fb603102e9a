"""What `python -m fermijit info` reports: the CPU and its SIMD features, the kernel variant each
op uses, Numba's threading, and whether the GPU path and ptxas are usable."""

from __future__ import annotations

import importlib
import pkgutil
import platform
import subprocess
from pathlib import Path

from fermijit.jit import cpu


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def mapping_bytes(address: int, field: str) -> int:
    """A /proc/self/smaps field ("Rss", "AnonHugePages", ...) in bytes for the mapping holding
    `address`; 0 where unknown (no /proc, no such mapping or field)."""
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    inside = False
    for line in smaps.splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == field + ":":
            return int(line.split()[1]) * 1024
    return 0


def op_variants(isa: cpu.Isa) -> list[tuple[str, str]]:
    """Each op module and its CPU kernel: hand-written SIMD (`simd_variant`) or Numba's own
    vectorisation for the target CPU."""
    import fermijit.ops

    rows = []
    for info in pkgutil.iter_modules(fermijit.ops.__path__):
        module = importlib.import_module(f"fermijit.ops.{info.name}")
        describe = getattr(module, "simd_variant", None)
        has_cpu = any(n == "cpu" or n.endswith("_cpu") for n in vars(module))
        if describe:
            rows.append((info.name, describe(isa)))
        elif has_cpu:
            rows.append((info.name, f"numba, auto-vectorised for {cpu.target_cpu_name()}"))
        else:
            rows.append((info.name, "no CPU kernel (numpy reference, GPU launcher)"))
    return rows


def threading(n_threads: int | None) -> str:
    import numba

    from fermijit.ops import matvec

    from fermijit.jit import omp

    n = cpu.configure_threads(n_threads)
    matvec.warm_up()  # the threading layer is chosen by the first parallel launch
    line = f"{numba.threading_layer()} layer, {n} threads (of {numba.config.NUMBA_NUM_THREADS})"
    if cpu.threads_pinned():
        line += ", thread t bound to physical core t (--pin-threads)"
    if not omp.available():
        line += "; W4A8 products run on one thread (they need the omp layer and libgomp)"
    return line


def gpu_status() -> str:
    from fermijit.jit import gpu

    reason = gpu.unavailable_reason()
    if reason is not None:
        return f"not usable: {reason}"
    cuda = gpu.driver()
    dev = cuda.Context.get_device()
    major, minor = dev.compute_capability()
    return f"{dev.name()} (sm_{major}{minor}, {dev.total_memory() / 2 ** 30:.1f} GiB)"


def ptxas_status() -> str:
    from fermijit import FermijitError
    from fermijit.jit.ptx_check import find_ptxas

    try:
        path = find_ptxas()
    except FermijitError as e:
        return f"not usable: {e}"
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    version = next((line for line in out.splitlines() if "release" in line), out.strip())
    return f"{path} ({version.strip()})"


def describe(n_threads: int | None) -> list[tuple[str, str]]:
    isa = cpu.selected_isa()
    features = cpu.host_features()
    rows = [
        ("cpu", cpu_model()),
        ("simd features", " ".join(f for f in cpu.SHOWN_FEATURES if f in features)),
        ("codegen target", f"{cpu.target_cpu_name()}"
                           + (" (forced, no extra features)" if cpu.target_cpu_name() == cpu.WESTMERE
                              and cpu.WESTMERE != cpu.llvm.get_host_cpu_name() else "")),
        ("isa", f"{isa.label} (available: "
                f"{', '.join(i.label for i in cpu.PREFERENCE if cpu.supported(i))})"),
        ("decode isa", f"{cpu.decode_isa().label} (one-token products; --decode-isa)"),
    ]
    rows += [(f"  op {name}", variant) for name, variant in op_variants(isa)]
    rows += [("threading", threading(n_threads)), ("gpu", gpu_status()),
             ("ptxas", ptxas_status())]
    return rows
