"""A paired A/B of two `serve` start modes (tests/fermijit/server/start_bench.py MODES and ENV)
in fresh processes, ABBA-interleaved so that drifting load falls on both: per pair, B's
exec-to-"ready" and Popen-to-"serving" over A's; the median ratio and the medians. No requests
(the start alone). On this 2-core machine: `main-cpu` against `cpu` (both --prefill cpu).

    python3 -m tests.fermijit.server.start_ab MODEL_DIR A B [PAIRS]
"""

import statistics
import sys
import tempfile
from pathlib import Path

from tests.fermijit.server import start_bench

PAIRS = 6


def main(model_dir: Path, a: str, b: str, pairs: int = PAIRS) -> None:
    log = Path(tempfile.mkdtemp(prefix="fermijit-start-ab-")) / "start-ab.log"
    start_bench.start(model_dir, a, log, requests=False)  # the kernel cache filled, if cold
    rows = {a: [], b: []}
    for p in range(pairs):
        for mode in (a, b) if p % 2 == 0 else (b, a):
            rows[mode].append(start_bench.start(model_dir, mode, log, requests=False))
    print(f"{pairs} pairs of fresh starts, {a} (A) and {b} (B); logs in {log}")
    for key in ("ready_s", "serving_s", "imports", "load", "kernels"):
        pairs_ = [(x[key], y[key]) for x, y in zip(rows[a], rows[b]) if key in x and key in y]
        if pairs_:
            ratios = [y / x for x, y in pairs_ if x > 0]
            name = start_bench.SHORT.get(key, key)
            print(f"{name:16s} A {statistics.median(x for x, _ in pairs_):6.2f}"
                  f"  B {statistics.median(y for _, y in pairs_):6.2f}  B/A median "
                  f"{statistics.median(ratios) if ratios else float('nan'):.3f} "
                  f"({', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3],
         int(sys.argv[4]) if len(sys.argv) > 4 else PAIRS)
