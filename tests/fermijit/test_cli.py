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


def test_bad_flags_are_one_line_errors():
    for args in (["--isa", "mmx", "info"], ["info", "--threads", "0"], ["frobnicate"],
                 ["bench", "kernels", "--gib", "0"]):
        r = fermijit(*args)
        assert r.returncode == 2, (args, r.returncode)
        assert "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("Error"), r.stderr


def test_threads_above_the_cores_is_refused():
    r = fermijit("info", "--threads", "4096")
    assert r.returncode == 2 and "--threads must be between 1 and" in r.stderr
    assert "Traceback" not in r.stderr
