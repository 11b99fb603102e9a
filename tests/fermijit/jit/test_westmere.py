"""Westmere conformance (DESIGN.md, Testing 4): the SSSE3 kernels compiled for a Westmere target
use pmaddubsw, no VEX encoding and no ymm/zmm register, compute the right result, and run under
`qemu-x86_64 -cpu Westmere`, where an AVX instruction dies with SIGILL (the negative control)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

# Runs in a fresh process: the Numba target is fixed by the first compile (notes, pitfall 2).
CHECK = textwrap.dedent("""
    import json, re, sys
    import numpy as np
    from fermijit.jit import cpu
    isa = cpu.select_isa(sys.argv[1])
    from fermijit.ops import (attention, fp32_rows, gdn_rows, gemm, kquant, kquant_matvec, kv_quant,
                              matvec, quant, quantize_rows)
    rng = np.random.default_rng(7)
    qs, d = quant.quantize_q4_0(rng.standard_normal((13, 1056)).astype(np.float32))
    x = rng.standard_normal((3, 1056)).astype(np.float32)
    y = matvec.cpu(qs, d, x[0], isa=isa), matvec.cpu(qs, d, x, isa=isa)
    ref = matvec.reference(qs, d, x[0]), matvec.reference(qs, d, x)
    q8s, q8d = quant.quantize_q8_0(rng.standard_normal((9, 1056)).astype(np.float32))
    y += (matvec.q8_cpu(q8s, q8d, x[0], isa=isa),)
    ref += (matvec.q8_reference(q8s, q8d, x[0]),)
    y += (fp32_rows.cpu(x, x[:2], isa=isa),)  # the router and gates' fp32 product
    ref += (fp32_rows.reference(x, x[:2]),)
    # attention over a Q8_0 KV cache (issue 31): a decode step split into key ranges, a prefill
    k8, v8 = (kv_quant.reference(rng.standard_normal((2, 700, 64)).astype(np.float32))
              for _ in range(2))
    for t, start in ((1, 650), (40, 600)):
        q, g = rng.standard_normal((2, t, 8, 64)).astype(np.float32)
        y += (attention.cpu(q, k8, v8, g, start, isa=isa),)
        ref += (attention.reference(q, k8, v8, g, start),)
    # decode's residual step: its row's quantisation (quantize_rows.rows_serial's row) is
    # matvec.quantize_act's, bit for bit
    from fermijit.ops import residual_step
    norm = rng.standard_normal(1056).astype(np.float32)
    xn1, p1 = np.empty((1, 1056), np.float32), np.empty((1, 2), np.float32)
    act1 = matvec.quantize_act(np.zeros((1, 1056), np.float32), isa)
    residual_step.cpu(x[:1].copy(), x[1:2].copy(), norm, 1e-6, xn1, act1, x[:2].copy(), p1)
    _, want_xn, want_p = residual_step.reference(x[:1], x[1:2], norm, 1e-6, x[:2])
    own = matvec.quantize_act(xn1, isa)
    y += (xn1, p1, act1.dx, act1.xq.astype(np.float32), act1.xsum8.astype(np.float32))
    ref += (want_xn, want_p, own.dx, own.xq.astype(np.float32), own.xsum8.astype(np.float32))
    kb = rng.integers(0, 256, (5, kquant.Q4_K.n_bytes(512)), dtype=np.uint8)
    kb.reshape(5, 2, 144)[..., :4] = np.array([0.01, 0.002], np.float16).view(np.uint8)
    x512 = np.ascontiguousarray(x[:, :512])
    y += (kquant_matvec.cpu(kquant.Q4_K, kb, x512[0], isa=isa),
          kquant_matvec.cpu(kquant.Q4_K, kb, x512, isa=isa))
    ref += (kquant.reference(kquant.Q4_K, kb, x512[0]), kquant.reference(kquant.Q4_K, kb, x512))
    # a verify step's GDN rows, 2 steps of 2 rows with the last row left pending (the lazy row:
    # the pair, the pending row applied in its first sweep, then settled)
    R, Hk, Hv, dk, dv = 2, 2, 4, 32, 32
    C = 2 * Hk * dk + Hv * dv
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    conv_w = 0.5 * f32(C, 4)
    A_log, dt_bias, norm_w = rng.uniform(0, 2, Hv).astype(np.float32), f32(Hv), f32(dv)
    conv_want, state_want = f32(C, 3), 0.1 * f32(Hv, dk, dv)
    live, conv_live, conv_save = state_want.copy(), conv_want.copy(), np.empty_like(conv_want)
    pending = gdn_rows.Pending(Hk, Hv, dk, dv)
    rows = lambda x: [x[r:r + 1] for r in range(R)]  # noqa: E731
    for step in range(2):
        mixed, z, a, b = f32(R, C), f32(R, Hv, dv), f32(R, Hv), f32(R, Hv)
        want = gdn_rows.reference(mixed, z, a, b, conv_w, conv_want, A_log, dt_bias, norm_w,
                                  1e-6, 1e-6, state_want)
        o = np.empty((R, Hv, dv), np.float32)
        acts = matvec.quantize_act(np.zeros((R, Hv * dv), np.float32), isa)
        gdn_rows.cpu(rows(mixed.copy()), rows(z), rows(a), rows(b), conv_w,
                     [conv_live, conv_save], [conv_save, conv_live], A_log, dt_bias, norm_w,
                     1e-6, 1e-6, [live], [live], gdn_rows.Scratch(R, Hk, Hv, dk, dv), rows(o),
                     [matvec.Q8Act(acts.xq[r:r + 1], acts.dx[r:r + 1], acts.xsum8[r:r + 1],
                                   acts.vec) for r in range(R)], pending)
        y += (o, live.copy())                              # the state after row 0
        ref += (want[0], want[2][0])
        conv_want, state_want = want[1][1], want[2][1]
    pending.settle(live)
    y += (live,)
    ref += (state_want,)
    # a verify step's MoE rows (the union of 2 tokens' experts, 2 shared): each decode's
    from fermijit.ops import moe
    E, H, I, K = 6, 160, 64, 3
    q4 = lambda *s: quant.quantize_q4_0(0.3 * f32(*s))  # noqa: E731
    (gq, gd), (dq, dd), (sgq, sgd), (sdq, sdd) = (q4(E, 2 * I, H), q4(E, H, I), q4(1, 2 * I, H),
                                                  q4(1, H, I))
    w = moe.MoeWeights(gq, gd, dq, dd, sgq, sgd, sdq, sdd, 0.1 * f32(H))
    ids = np.array([[0, 2, 4], [4, 5, 2]], np.int32)
    wts = np.full((2, K), 1 / K, np.float32)
    xm = f32(2, H)
    got = np.empty((2, H), np.float32)
    kernel_, args = moe.rows_launch(xm, matvec.quantize_act(xm, isa), ids, wts, w, got,
                                    moe.RowsScratch.make(w, K, 2))
    kernel_(*args)
    for t in range(2):
        one = np.empty((1, H), np.float32)
        moe.decode(xm[t:t + 1], matvec.quantize_act(xm[t:t + 1], isa), ids[t:t + 1],
                   wts[t:t + 1], w, one, moe.Scratch.make(w, K))
        y += (got[t:t + 1],)
        ref += (one,)
    kernels = [matvec.gemv_kernel(isa), matvec._product(isa, matvec.GEMM_TILE)]
    kernels.append(gdn_rows._rows_kernel())
    kernels.append(moe._union_kernel(isa))
    kernels.append(attention._kernel(isa))
    kernels.append(matvec.gemv_kernel(isa, matvec.Q8_0))
    kernels.append(gemm.product_kernel(isa))  # the prefill GEMM, which matvec.cpu(x) ran
    kernels.append(quantize_rows._quantize_rows)  # prefill's quantisation, which it ran too
    kernels.append(residual_step._step_kernel())  # decode's residual step, with its row's
    kernels.append(fp32_rows._kernels[isa]())  # made on first use (a forking kernel)
    kernels += [kquant_matvec.product_kernel(kquant.Q4_K, isa, s)
                for s in (kquant_matvec.GEMV_TILE, (1, 2), kquant_matvec.GEMM_TILE)]
    asm = "\\n".join(a for k in kernels for a in k.inspect_asm().values())
    err = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(y, ref))
    print(json.dumps({"err": err, "cpu": cpu.target_cpu_name(),
                      "pmaddubsw": len(re.findall(r"\\bpmaddubsw\\b", asm)),
                      "vex": len(re.findall(r"^\\s+v[a-z0-9]+\\s", asm, re.M)),
                      "wide_regs": len(re.findall(r"%[yz]mm", asm))}))
""")

NEGATIVE = textwrap.dedent("""
    import numpy as np
    from fermijit.jit.cpu import Isa
    from fermijit.ops import matvec, quant
    qs, d = quant.quantize_q4_0(np.ones((8, 512), np.float32))
    x = np.ones(512, np.float32)
    act = matvec.quantize_act(x, Isa.AVX2)
    matvec.gemv_kernel(Isa.AVX2)(qs, d.view(np.uint16), act.xq, act.dx, act.xsum8,
                                 np.empty((1, 8), np.float32))
    print("ran AVX2 code")
""")

ERR = 1e-5


def _run(args, env_extra=None, timeout=600):
    env = dict(os.environ, **(env_extra or {}))
    env.pop("FERMIJIT_ISA", None)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def test_ssse3_kernels_compile_for_westmere_without_vex(tmp_path):
    # A fresh cache: Numba cannot show the assembly of code it loaded from its cache.
    r = _run([sys.executable, "-c", CHECK, "ssse3"], {"NUMBA_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["cpu"] == "westmere"
    assert got["pmaddubsw"] > 0, "the SSSE3 kernel lost its pmaddubsw"
    assert got["vex"] == 0, f"{got['vex']} VEX-encoded instructions in Westmere code"
    assert got["wide_regs"] == 0, "ymm/zmm registers in Westmere code"
    assert got["err"] < ERR


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="qemu-user is not installed")
def test_ssse3_gemv_runs_on_emulated_westmere():
    # sys.executable as it is (not resolved): the venv is found from that path.
    qemu = [shutil.which("qemu-x86_64"), "-cpu", "Westmere", sys.executable]
    # This host may pin OpenBLAS to Haswell kernels (OPENBLAS_CORETYPE); an emulated Westmere
    # needs Nehalem's, or numpy's import dies with SIGILL before any fermijit code runs.
    westmere_env = {"OPENBLAS_CORETYPE": "NEHALEM"}
    # Populate the Numba cache natively first, so the emulated run only executes kernels.
    assert _run([sys.executable, "-c", CHECK, "ssse3"]).returncode == 0
    r = _run(qemu + ["-c", CHECK, "ssse3"], westmere_env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["cpu"] == "westmere" and got["err"] < ERR

    # Negative control: the same emulator must refuse AVX2 code (else it proves nothing).
    from fermijit.jit import cpu
    if not cpu.supported(cpu.Isa.AVX2):
        pytest.skip("this host has no AVX2 to build the negative control with")
    from numba.core.registry import cpu_target
    _, name, features = cpu_target.target_context.codegen().magic_tuple()
    host = {"NUMBA_CPU_NAME": name, "NUMBA_CPU_FEATURES": features}
    assert _run([sys.executable, "-c", NEGATIVE], host).returncode == 0  # native: cache + runs
    r = _run(qemu + ["-c", NEGATIVE], dict(host, **westmere_env))
    assert "ran AVX2 code" not in r.stdout
    assert r.returncode in (-signal.SIGILL, 128 + signal.SIGILL), (r.returncode, r.stderr[-500:])
