"""The command line: help is instant and lists the verbs; bad input is one line and exit 2."""

import subprocess
import sys


def fermijit(*args, env=None):
    return subprocess.run([sys.executable, "-m", "fermijit", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_help_lists_the_subcommands():
    r = fermijit("--help")
    assert r.returncode == 0
    for verb in ("info", "bench"):
        assert verb in r.stdout
    r = fermijit("bench", "--help")
    assert r.returncode == 0 and "kernels" in r.stdout


def test_version_is_the_package_s():
    import fermijit as package

    r = fermijit("--version")
    assert r.returncode == 0 and r.stdout == f"fermijit {package.__version__}\n"


def test_help_does_not_import_numba():
    code = ("import sys; from fermijit.cli import cli; "
            "print('numba' in sys.modules, 'pycuda' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == ["False", "False"]


def test_info_reports_the_machine():
    r = fermijit("info", "--threads", "1")
    assert r.returncode == 0, r.stderr
    for key in ("cpu:", "simd features:", "isa:", "op matvec:", "threading:", "gpu:", "ptxas:"):
        assert key in r.stdout
    assert "1 threads" in r.stdout


def test_decode_isa_reaches_info():
    r = fermijit("--decode-isa", "ssse3", "info", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "decode isa:            ssse3" in r.stdout and "decode GEMV ssse3: 128-bit" in r.stdout


def test_bad_flags_are_one_line_errors():
    for args in (["--isa", "mmx", "info"], ["--decode-isa", "sse9", "info"],
                 ["info", "--threads", "0"], ["frobnicate"],
                 ["bench", "kernels", "--gib", "0"],
                 ["bench", "decode", "--synthetic", "x", "--threads-sweep", "1,0"],
                 ["bench", "decode", "--synthetic", "x", "--threads-sweep", "two"]):
        r = fermijit(*args)
        assert r.returncode == 2, (args, r.returncode)
        assert "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("Error"), r.stderr


def test_threads_above_the_cores_is_refused():
    r = fermijit("info", "--threads", "4096")
    assert r.returncode == 2 and "--threads must be between 1 and" in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_kernels_reports_every_shape_and_variant():
    """The smallest cold set: the report's structure, not its speeds (timed tests are noise)."""
    import json

    from fermijit.bench.kernels import GEMM_SHAPES, GEMV_SHAPES, KQUANT_GEMVS
    from fermijit.jit import cpu

    r = fermijit("bench", "kernels", "--gib", "0.0625", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["rows"]
    got = {(row["what"], row["variant"]) for row in rows}
    variants = [isa.label for isa in cpu.variants_up_to(cpu.selected_isa())]
    if cpu.target_cpu_name() != cpu.WESTMERE:
        variants.append("ssse3/wsm")
    for rows_, k in GEMV_SHAPES:
        for variant in variants:
            assert (f"gemv {rows_}x{k} cold", variant) in got
    rows_, k = GEMV_SHAPES[0]
    for fmt in KQUANT_GEMVS:  # issue 34 item 4: beside Q4_0's, with the ratio of the two
        for variant in variants:
            assert (f"gemv {rows_}x{k} cold {fmt.name}", variant) in got
            assert (f"gemv {rows_}x{k} {fmt.name}/q4_0", variant) in got
    for variant in variants:
        assert ("gemv all shapes", variant) in got
        for kind in (" hot", "gemv launch"):
            assert any(kind in what and v == variant for what, v in got), (kind, variant)
    assert any(what == "read bandwidth (best)" for what, _ in got)
    for n_tok, rows_, k in GEMM_SHAPES:
        for variant in variants[:-1] if "ssse3/wsm" in variants else variants:
            assert (f"gemm {n_tok}x{rows_}x{k}", variant) in got
    for row in rows:
        assert row["value"] > 0 and (row["ratio"] is None or 0 < row["ratio"] < 10), row
