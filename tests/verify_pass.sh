#!/usr/bin/env bash
# Issue 32 item 4 (a 2-row verify step <= 1.35x a token, full-size reap128), at 16 threads on the
# GPU machine's host, in one command of < 4 minutes: `bench decode --speculative mtp` in 3 fresh
# processes (verify_of_decode and the split of both steps by plan label), then three probes of
# the verify step's parts against a token's, each cold (every layer's weights in turn), medians
# of interleaved rounds: the residual step (1 row vs 2: its serial row work, the router's fp32
# product), the fused MoE (1 token vs 2, GB/s of the distinct experts read) and the few-token
# products (the dense matrices and the Q8_0 LM head, 2 tokens vs the 1-token GEMV). A table last.
# Usage, from the project root: bash tests/verify_pass.sh OUT   (carry .device-wheels)
# Settings: MODEL (default /dev/shm/fj-reap128; synthesised there if absent, ~1 min), THREADS
# (default 16), PYTHON (default python3), ROUNDS (bench rounds, default 3).
set -u
out=${1:?usage: tests/verify_pass.sh OUTDIR}
mkdir -p "$out"
start=$SECONDS
if [ -d .device-wheels ]; then source "$(dirname "$0")/gpu_install.sh"; fi
py=${PYTHON:-python3}
model=${MODEL:-/dev/shm/fj-reap128}
threads=${THREADS:-16}
log="$out/verify.log"
step() { echo "[$((SECONDS - start)) s] $*" | tee -a "$log"; }
{ lscpu | head -20; free -g; uptime; git log --oneline -1 2>/dev/null; } >>"$log" 2>&1
[ -f "$model/fermijit.json" ] || $py -m fermijit synth qwen3.6-35b-a3b-reap128 "$model" >>"$log" 2>&1
step "model ready ($model), threads $threads"
# compiles into the cache (a machine whose cache is cold: a few minutes more than the < 4 above)
timeout 300 $py -m fermijit bench decode --model "$model" --speculative mtp --prompts 1 \
  --prompt-tokens 8 --tokens 4 --threads "$threads" >>"$log" 2>&1 || step "warm-up failed"
step "kernels compiled"
for r in $(seq 1 "${ROUNDS:-3}"); do
  timeout 100 $py -m fermijit bench decode --model "$model" --speculative mtp --prompts 1 \
    --prompt-tokens 32 --tokens 16 --threads "$threads" --json >"$out/spec-r$r.json" 2>>"$log" \
    || step "bench round $r failed"
  step "bench round $r done ($(uptime | sed 's/.*load/load/'))"
done
timeout 100 $py - "$model" "$threads" >"$out/probes.txt" 2>>"$log" <<'EOF' || step "probes failed"
import sys, time
import numpy as np
from fermijit.jit import cpu
cpu.configure_threads(int(sys.argv[2]))
from fermijit.model.forward import load_model
from fermijit.model.weights import QuantTensor
from fermijit.ops import matvec, moe, residual_rows, residual_step

_, model = load_model(sys.argv[1])
isa, L, H, k = cpu.decode_isa(), len(model.layers), model.hidden, model.top_k
rng = np.random.default_rng(0)
f32 = np.float32


def act(T, K):
    return matvec.quantize_act(rng.standard_normal((T, K)).astype(f32), isa)


def timed(cases, rounds, before=None):
    """{case: [seconds of a round]}: each round every case's launches in turn."""
    res = {c: [] for c in cases}
    for _ in range(rounds):
        for c, launches in cases.items():
            if before:
                before(c)
            t = time.perf_counter()
            for fn, args in launches:
                fn(*args)
            res[c].append(time.perf_counter() - t)
    return res


def report(name, res, per):
    (c1, t1), (c2, t2) = res.items()
    print(f"{name}: {c1} {1e6 * np.median(t1) / per:.1f} us, {c2} {1e6 * np.median(t2) / per:.1f}"
          f" us a call; ratio {np.median(np.array(t2) / t1):.3f}")


# residual steps: every layer's router (post-norm) and a no-product step (input norm)
def res_launches(R, routed):
    x = matvec.aligned_empty((R, H)); x[:] = rng.standard_normal((R, H))
    y = matvec.aligned_empty((R, H)); y[:] = 0.01 * rng.standard_normal((R, H))
    xn, a = matvec.aligned_empty((R, H)), act(R, H)
    mod = residual_step if R == 1 else residual_rows
    out = []
    for w in model.layers:
        if routed:
            p = np.empty((R, w.router.shape[0]), f32)
            out.append(mod.launch(x, y, w.post_norm, model.eps, xn, a, w.router, p,
                                  np.empty((R, k), np.int32), np.empty((R, k), f32)))
        else:
            out.append(mod.launch(x, y, w.input_norm, model.eps, xn, a, np.empty((0, H), f32),
                                  np.empty((R, 0), f32), np.empty((R, 0), np.int32),
                                  np.empty((R, 0), f32)))
    return out


for routed in (False, True):
    report(f"residual {'router' if routed else 'no product'}",
           timed({"1 row": res_launches(1, routed), "2 rows": res_launches(2, routed)}, 20), L)

# the fused MoE, random routing
w0 = model.layers[0].experts
per_expert = sum(a[0].nbytes for a in w0.routed)
shared = sum(a.nbytes for a in w0.shared)
moe_ids, moe_bytes = {}, {1: [], 2: []}


def moe_launches(R):
    xs = [rng.standard_normal((1, H)).astype(f32) for _ in range(R)]
    acts = [matvec.quantize_act(x, isa) for x in xs]
    ids = moe_ids[R] = [np.zeros((1, k), np.int32) for _ in range(R)]
    scratch = [moe.Scratch.make(w0, k) for _ in range(R)]
    return [moe.rows_launch(xs, acts, ids, [np.full((1, k), 1 / k, f32)] * R, w.experts,
                            [np.empty((1, H), f32) for _ in range(R)], scratch)
            for w in model.layers]


def route(c):
    R = 1 if c == "1 token" else 2
    for i in moe_ids[R]:
        i[0] = rng.choice(model.n_experts, k, replace=False)
    moe_bytes[R].append(len(np.unique(np.concatenate([i[0] for i in moe_ids[R]]))) * per_expert
                        + shared)


res = timed({"1 token": moe_launches(1), "2 tokens": moe_launches(2)}, 20, route)
report("moe (routing the same every layer of a round)", res, L)
for R, c in ((1, "1 token"), (2, "2 tokens")):
    print(f"  moe {c}: {np.median(np.array(moe_bytes[R]) * L / res[c]) / 1e9:.1f} GB/s")

# the products: the mixers' Q4_0 matrices, then the LM head
mats = []
for w in model.layers:
    m = w.mixer
    mats += [w.joined_in] + [getattr(m, n) for n in ("o_proj", "out_proj") if hasattr(m, n)]
mats = [m for m in mats if isinstance(m, matvec.Q4Matrix)]


def prod_launches(T):
    out = [matvec.launch(m, act(T, m.qs.shape[1] * 2), np.empty((T, m.qs.shape[0]), f32),
                         like_gemv=T > 1) for m in mats]
    head = model.lm_head
    if isinstance(head, QuantTensor):
        out.append(matvec.q8_launch(head.qs, head.d, act(T, H),
                                    np.empty((T, head.qs.shape[0]), f32)))
    return out


report("products + head", timed({"1 token": prod_launches(1), "2 tokens": prod_launches(2)},
                                10), len(mats) + 1)
EOF
step "probes done"
$py - "$out" <<'EOF' | tee -a "$log"
import glob, json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{out}/spec-r*.json"))]
runs = [r for r in runs if "costs" in r]
if runs:
    print("split, ms (median of the rounds' best): token / verify / ratio")
    # a token's step and the verify step's rows of the same part in one line
    same = {"gdn_rows.cpu": "gdn_step.cpu", "residual_rows.cpu": "residual_step.cpu"}
    for r in runs:
        split = {}
        for l, (d, v) in r.get("split", {}).items():
            row = split.setdefault(same.get(l, l), [0.0, 0.0])
            row[0] += d
            row[1] += v
        r["split"] = split
    labels = {l for r in runs for l in r["split"]}
    rows = []
    for l in labels:
        d = statistics.median(r["split"].get(l, [0, 0])[0] for r in runs)
        v = statistics.median(r["split"].get(l, [0, 0])[1] for r in runs)
        rows.append((max(d, v), l, d, v))
    for _, l, d, v in sorted(rows, reverse=True):
        print(f"  {l:<28} {d:7.2f} {v:7.2f} {v / d if d else float('nan'):6.2f}")
    print((Path(out) / "probes.txt").read_text() if (Path(out) / "probes.txt").exists() else "")
    for r in runs:
        c = r["costs"]
        print(f"round: token {c['decode_ms']:.2f} ms, verify {c['verify_ms']:.2f} ms, "
              f"verify/token {r['verify_of_decode']:.3f}, identical {r['identical_text']}, "
              f"load {r['load_1min']}")
    print(f"verify/token median {statistics.median(r['verify_of_decode'] for r in runs):.3f} "
          f"(target <= 1.35)")
EOF
step "done"
