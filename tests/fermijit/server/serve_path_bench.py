"""The server's own path to a first token, on the CPU (issue 28 item 5: 8 concurrent 64-token
prompts' last first token within 2x one prompt's): `serve`'s scheduler and HTTP API over a model
directory (an 8-layer reap128 slice: the full-size states per layer) with a stand-in for the GPU
prefill that costs nothing but writing its states' GDN arrays (as the hand-off does) and
PREFILL_S of sleep; so what it prints is the scheduler's and the host's share. Prints, per round,
one prompt alone (median of 3) and two batches of N_CONCURRENT at once (the second arrives as the
first ends: on the pool's recycled states), and the scheduler's --verbose lines.

    python3 -m tests.fermijit.server.serve_path_bench MODEL_DIR [ROUNDS]
"""

import concurrent.futures
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from fermijit.prefill.hybrid import CpuPrefiller
from tests.fermijit.server.test_prefill_chunks import serving
from tests.fermijit.server.test_serve_gpu import _ttft

N_CONCURRENT, N_SHORT, PREFILL_S = 8, 64, 0.05


class Instant(CpuPrefiller):
    """The GPU prefill's contract at no cost: positions advanced, GDN arrays written, logits."""

    chunk_tokens = None
    runs_beside_decode = True
    verbose = True

    def reserve(self, n_sequences):
        pass

    def prefill_batch(self, items, align=None):
        from fermijit.model.state import GdnState

        time.sleep(PREFILL_S)
        for i in items:
            for s in i.state.layers:
                if isinstance(s, GdnState):
                    s.conv.fill(0.5)
                    s.recurrent.fill(0.5)
            i.state.position += i.tokens.size
        return [np.zeros(self.model.vocab_size, np.float32) for _ in items]


def main(model_dir: Path, rounds: int) -> None:
    import httpx

    from fermijit.engine import Engine
    from fermijit.server.run import warm_up

    engine = Engine.load(model_dir)
    warm_up(engine, N_CONCURRENT)
    rng = np.random.default_rng(0)
    ids = lambda: rng.integers(300, engine.model.vocab_size - 300, N_SHORT).tolist()  # noqa: E731
    rows = []
    with serving(engine, Instant(engine.model)) as (url, _):
        with httpx.Client(base_url=url,
                          timeout=600) as client:
            _ttft(client, ids())
            for r in range(rounds):
                row = {"alone": statistics.median(_ttft(client, ids()) for _ in range(3))}
                for key in ("first", "second"):
                    prompts = [ids() for _ in range(N_CONCURRENT)]
                    with concurrent.futures.ThreadPoolExecutor(N_CONCURRENT) as pool:
                        row[key] = max(pool.map(lambda p: _ttft(client, p), prompts))
                rows.append(row)
                print(f"round {r + 1}: one alone {row['alone']:.3f} s, {N_CONCURRENT} together "
                      f"{row['first']:.3f} s ({row['first'] / row['alone']:.2f}x), again "
                      f"{row['second']:.3f} s ({row['second'] / row['alone']:.2f}x)", flush=True)
    alone = statistics.median(r["alone"] for r in rows)
    for key in ("first", "second"):
        last = statistics.median(r[key] for r in rows)
        print(f"median: {N_CONCURRENT} together ({key}) {last:.3f} s, alone {alone:.3f} s: "
              f"{last / alone:.2f}x (stand-in prefill {PREFILL_S} s a call)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
