"""Where `serve`'s start goes (issue 28 item 4), run by tests/gpu_serve_bench.sh on the GPU host
after the serve bench (the kernel cache warm): one start under `-X importtime` (the slowest
imports) and one under cProfile (the functions with the most cumulative time), each stopped by
SIGINT once it says "serving". Writes OUT/start-profile.txt.

    python3 -m tests.fermijit.server.start_profile MODEL_DIR OUT
"""

import pstats
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.fermijit.server.test_serve_gpu import GPU_MEM


def start(model_dir: Path, python_flags: list[str]) -> tuple[float, str]:
    """(seconds from Popen to "serving", stderr) of a `serve` stopped by SIGINT once serving."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *python_flags, "-m", "fermijit", "serve", "--model",
                             str(model_dir), "--port", "0", "--gpu-mem", GPU_MEM, "--verbose"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines, ready = [], None
    for line in proc.stderr:
        lines.append(line)
        if re.search(r"serving on http", line):
            ready = time.perf_counter() - t0
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    return ready, "".join(lines) + (rest or "")


def top_level_imports(log: str) -> list[tuple[float, str]]:
    """(seconds, module) of the imports the program made itself in -X importtime's lines of
    `log` (not those made by another import), slowest first."""
    found = []
    for line in log.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if m and not m.group(3):
            found.append((int(m.group(2)) / 1e6, m.group(4)))
    return sorted(found, reverse=True)


def main(model_dir: Path, out: Path) -> None:
    report = []
    ready, log = start(model_dir, ["-X", "importtime"])
    imports = top_level_imports(log)
    report.append(f"-X importtime start: {ready:.2f} s to serving; top-level imports "
                  f"{sum(t for t, _ in imports):.2f} s, the largest:")
    report += [f"  {t:6.3f} s  {name}" for t, name in imports[:15]]
    report += [line for line in log.splitlines() if "ready" in line]
    prof = out / "start.prof"
    ready, log = start(model_dir, ["-m", "cProfile", "-o", str(prof)])
    report.append(f"cProfile start: {ready:.2f} s to serving (profiled: slower); "
                  + "; ".join(line for line in log.splitlines() if "ready" in line))
    (out / "start-profile.txt").write_text("\n".join(report) + "\n")
    with open(out / "start-profile.txt", "a") as f:
        if prof.exists():
            pstats.Stats(str(prof), stream=f).sort_stats("cumulative").print_stats(40)
        else:
            f.write("no profile written\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
