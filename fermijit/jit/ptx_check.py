"""`python -m fermijit kernels check`: Fermi conformance of every PTX variant, with no GPU.

Every variant the engine may launch (each template's full parameter product, fermijit.jit.ptx)
is rendered and assembled by ptxas. The PTX declares `.target sm_20`, so ptxas rejects any
instruction Fermi lacks (shfl, dp4a, fp16 arithmetic, ...), whatever machine code it is asked
for; it is asked for ARCH, the oldest target CUDA 13's ptxas still generates. From `ptxas -v` we
report registers, spills and shared memory per kernel and fail where a block would need more than
Fermi's 48 KB of shared memory or 1024 threads. Registers: every entry declares `.maxnreg 63`
(the renderer insists), so ptxas spills instead of exceeding Fermi's 63; kernels that spill are
listed as over the budget. Their count is for ARCH, a guide to what sm_20 would need.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from fermijit import FermijitError
from fermijit.jit import ptx

ARCH = "sm_75"
_INFO = re.compile(r"Compiling entry function '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass
class KernelReport:
    """One entry of one rendered variant, as ptxas saw it."""

    variant: str          # template(params)
    entry: str
    registers: int
    spill_bytes: int      # stores + loads
    shared_bytes: int
    max_threads: int      # .maxntid
    problems: list[str]   # why it fails Fermi's limits; empty when it conforms

    @property
    def is_ok(self) -> bool:
        return not self.problems


def find_ptxas(explicit: Path | None = None) -> Path:
    """ptxas: `explicit`, else PATH, else CUDA's default folder, else the nvidia-cuda-nvcc wheel."""
    candidates = [explicit] if explicit is not None else []
    on_path = shutil.which("ptxas")
    candidates += [Path(on_path)] if on_path else []
    candidates.append(Path("/usr/local/cuda/bin/ptxas"))
    try:
        import nvidia.cuda_nvcc  # the nvidia-cuda-nvcc wheel ships ptxas beside its package

        candidates.append(Path(list(nvidia.cuda_nvcc.__path__)[0]) / "bin" / "ptxas")
    except ImportError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    if explicit is not None:
        raise FermijitError(f"ptxas not found at {explicit}")
    raise FermijitError("ptxas not found: install the CUDA toolkit or "
                        "`pip install nvidia-cuda-nvcc`, or pass --ptxas")


def assemble(rendered: ptx.Rendered, ptxas: Path) -> list[KernelReport]:
    """Assemble one rendered variant; one report per entry. A ptxas error is a report whose
    problem is the error (with the PTX line it names)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / f"{rendered.template}.ptx"
        source.write_text(rendered.text)
        proc = subprocess.run([str(ptxas), f"-arch={ARCH}", "-v", str(source),
                               "-o", str(Path(tmp) / "out.cubin")],
                              capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        errors = [line.split(": ", 1)[-1].strip() for line in log.splitlines()
                  if "error" in line or "fatal" in line]
        return [KernelReport(rendered.label, name, 0, 0, 0, e.max_threads,
                             errors or [f"ptxas exited {proc.returncode}"])
                for name, e in rendered.entries.items()]
    return [_report(rendered, name, section) for name, section in _sections(log)]


def _sections(log: str) -> list[tuple[str, str]]:
    """ptxas -v output cut into one piece per entry."""
    starts = list(_INFO.finditer(log))
    return [(m.group(1), log[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(log)])
            for i, m in enumerate(starts)]


def _report(rendered: ptx.Rendered, name: str, section: str) -> KernelReport:
    used = re.search(r"Used (\d+) registers", section)
    smem = re.search(r"(\d+) bytes smem", section)
    spill = _SPILL.search(section)
    registers = int(used.group(1)) if used else 0
    shared = int(smem.group(1)) if smem else 0
    spills = int(spill.group(1)) + int(spill.group(2)) if spill else 0
    threads = rendered.entries[name].max_threads
    problems = []
    if shared > ptx.FERMI_MAX_SHARED_BYTES:
        problems.append(f"{shared} bytes of shared memory > {ptx.FERMI_MAX_SHARED_BYTES}")
    if threads > ptx.FERMI_MAX_THREADS:
        problems.append(f".maxntid {threads} threads > {ptx.FERMI_MAX_THREADS}")
    return KernelReport(rendered.label, name, registers, spills, shared, threads, problems)


def check_all(ptxas: Path | None = None) -> list[KernelReport]:
    """Render and assemble every variant of every template."""
    path = find_ptxas(ptxas)
    reports = []
    for name in ptx.template_names():
        for params in ptx.variants(name):
            reports.extend(assemble(ptx.render(name, **params), path))
    return reports


def run(ptxas: Path | None = None, as_json: bool = False) -> int:
    """The command: a table (or JSON) on stdout; returns the exit status (1 if any fails)."""
    reports = check_all(ptxas)
    failed = [r for r in reports if not r.is_ok]
    over = [r for r in reports if r.registers > ptx.FERMI_MAX_REGISTERS or r.spill_bytes]
    if as_json:
        print(json.dumps({"arch": ARCH, "ptxas": str(find_ptxas(ptxas)),
                          "kernels": [asdict(r) | {"ok": r.is_ok} for r in reports]}, indent=1))
    else:
        width = max(len(r.variant) for r in reports)
        print(f"{'variant':<{width}}  {'entry':<24} {'regs':>4} {'spill B':>7} {'smem B':>6} "
              f"{'threads':>7}  result")
        for r in reports:
            result = "ok" if r.is_ok else "FAIL: " + "; ".join(r.problems)
            print(f"{r.variant:<{width}}  {r.entry:<24} {r.registers:>4} {r.spill_bytes:>7} "
                  f"{r.shared_bytes:>6} {r.max_threads:>7}  {result}")
        print(f"\n{len(reports)} kernels assembled for .target sm_20 by ptxas -arch={ARCH}: "
              f"{len(reports) - len(failed)} conform, {len(failed)} fail.")
        if over:
            print("Over Fermi's 63 registers (spilled under .maxnreg 63, on " + ARCH + "): "
                  + ", ".join(f"{r.entry} ({r.spill_bytes} B)" for r in over))
    if failed:
        print(f"kernels check: {len(failed)} kernel(s) break Fermi's limits", file=sys.stderr)
    return 1 if failed else 0
