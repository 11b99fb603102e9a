"""The sweep of the environment around the process (a full disk, signals, resource limits, a
closed stdin): each case a defect found, now one line (or one warning) and nothing partial left
looking whole. The full-disk cases need a tmpfs of a chosen size: root only, else skipped."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from fermijit.engine import DEFAULT_MODEL
from tests.cli import run_cli
from tests.fermijit.test_hardening import assert_one_line
from tests.model import tiny


@pytest.fixture
def small_disk(tmp_path):
    """A function: a new tmpfs of `size` bytes (mounted under tmp_path, unmounted after), filled
    to leave `free` bytes when given, or read-only."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = []

    def make(size: int, free: int | None = None, read_only: bool = False):
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
        mounted.append(where)
        if free is not None:
            with open(where / "fill", "wb") as f:
                f.write(b"\0" * (shutil.disk_usage(where).free - free))
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_export_onto_a_full_disk_says_so(small_disk, monkeypatch, capsys):
    """numpy's tofile (the gguf package's writes) says "3342336 requested and 1357664 written",
    without an errno: that was the whole error."""
    pytest.importorskip("gguf")
    disk = small_disk(4 << 20)  # the default model's GGUF is ~24 MB
    code, _, err = run_cli(monkeypatch, capsys, "export", DEFAULT_MODEL, disk / "m.gguf")
    assert_one_line(code, err, "export failed writing: No space left on device")
    assert "nothing was written to" in err
    assert list(disk.iterdir()) == []


def test_convert_onto_a_full_disk_names_no_file_of_the_source(small_disk, tmp_path, monkeypatch,
                                                               capsys):
    """Room for the weights but not the tokenizer: "convert failed writing
    SRC/tokenizer.json" (shutil.copyfile's error names its source) read as if the source
    were at fault."""
    src = tiny.write_checkpoint(tmp_path / "hf")
    disk = small_disk(1 << 20, free=384 << 10)  # the weights ~370 KiB, then the copies
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, disk / "c")
    assert_one_line(code, err, "convert failed writing")
    assert "No space left on device" in err and str(src) not in err
    assert sorted(p.name for p in disk.iterdir()) == ["fill"]


def test_export_into_a_read_only_folder_names_the_cause(small_disk, monkeypatch, capsys):
    """The cleanup's unlink of the .partial never made raised EROFS over the open's error."""
    pytest.importorskip("gguf")
    disk = small_disk(1 << 20, read_only=True)
    code, _, err = run_cli(monkeypatch, capsys, "export", DEFAULT_MODEL, disk / "m.gguf")
    assert_one_line(code, err, "export failed writing")
    assert f"Read-only file system; nothing was written to {disk / 'm.gguf'}" in err


def test_a_read_only_gguf_cache_names_the_remedy(small_disk, tmp_path, monkeypatch, capsys):
    """`--model x.gguf` converts into FERMIJIT_CACHE: "Error: Read-only file system: DIR"."""
    pytest.importorskip("gguf")
    gguf = tmp_path / "m.gguf"
    assert run_cli(monkeypatch, capsys, "export", DEFAULT_MODEL, gguf)[0] == 0
    disk = small_disk(1 << 20, read_only=True)
    monkeypatch.setenv("FERMIJIT_CACHE", str(disk / "cache"))
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--model", gguf, "def f",
                           "--max-tokens", 2, "--threads", 1)
    assert_one_line(code, err, f"cannot make the cache of converted GGUF files {disk}/cache/"
                               f"gguf: Read-only file system (set FERMIJIT_CACHE to a writable "
                               f"folder)")


def test_prune_of_an_hf_checkpoint_onto_a_full_disk_leaves_nothing(small_disk, tmp_path,
                                                                    monkeypatch, capsys):
    """The pruned HF checkpoint's writer had no cleanup: a shard of its whole size and header
    (its tail zeros) was left, and "Error: No space left on device"."""
    src = tiny.write_checkpoint(tmp_path / "hf")
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(tiny.CORPUS * 40))
    disk = small_disk(1 << 20, free=600 << 10)  # the pruned shard is ~1.3 MB
    code, _, err = run_cli(monkeypatch, capsys, "prune", src, disk / "p", "--text", text,
                           "--keep", 4, "--ctx", 64, "--max-tokens", 128, "--threads", 1)
    assert_one_line(code, err, f"prune failed writing: No space left on device; nothing was "
                               f"left in {disk / 'p'}")
    assert sorted(p.name for p in disk.iterdir()) == ["fill"]


KERNEL = textwrap.dedent("""
    from fermijit.jit.cpu import kernel

    @kernel
    def add_one(x):
        return x + 1

    print(add_one(41), add_one(1.5))
""")


def test_a_full_kernel_cache_compiles_and_runs(small_disk, tmp_path):
    """Numba raised the cache save's OSError out of the compile: every model command died of
    a full disk under NUMBA_CACHE_DIR (or the package's __pycache__)."""
    disk = small_disk(1 << 20, free=0)
    script = tmp_path / "kernel.py"  # a file: Numba caches only functions that have one
    script.write_text(KERNEL)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "NUMBA_CACHE_DIR": str(disk / "numba")})
    assert r.returncode == 0 and r.stdout == "42 2.5\n", r.stderr
    assert r.stderr.count("\n") == 1, r.stderr  # said once, for two saves
    assert "could not save compiled kernels in" in r.stderr
    assert "No space left on device; the next run compiles them again" in r.stderr


def test_snapshots_onto_a_full_disk_are_said_once(small_disk, tmp_path, monkeypatch, capsys):
    """A warning per snapshot that failed (35 lines for one 541-token prompt; a server's log
    filled the same way)."""
    disk = small_disk(1 << 20, free=0)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(x):\n    return x + 1\n" * 20)
    monkeypatch.setattr(sys, "stdin", open(prompt))
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--cache-dir", disk / "snap",
                             "--snapshot-every", 16, "--max-tokens", 2, "--temperature", 0,
                             "--threads", 1)
    assert code == 0 and out, err
    said = [line for line in err.replace("\r", "\n").splitlines() if "warning" in line]
    assert len(said) == 1 and "No space left on device" in said[0], err


@pytest.mark.parametrize("signum, exit_code, said", [
    (signal.SIGHUP, 2, "Error: convert: terminated (SIGHUP)"),
    (signal.SIGINT, 130, "Aborted."),  # was exit 1
])
def test_a_signal_removes_the_partial_output(tmp_path, signum, exit_code, said):
    """SIGHUP (the terminal or ssh session gone) killed a convert or synth outright: a 2.3 GB
    model.safetensors.partial stayed behind (SIGTERM's cleanup was SIGTERM's only)."""
    src = tiny.write_checkpoint(tmp_path / "src", "fused", "F32")
    code = textwrap.dedent(f"""
        import os, signal, sys
        from fermijit.model import convert
        from fermijit.cli import main
        real = convert.stream
        def stream(*args):
            for n in real(*args):
                if args[0] == "layers.1.mlp.experts_gate_up":
                    os.kill(os.getpid(), {int(signum)})
                yield n
        convert.stream = stream
        sys.argv = ["fermijit", "convert", {str(src)!r}, {str(tmp_path / "dst")!r}]
        main()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL))
    assert r.returncode == exit_code, r.stderr
    assert r.stderr.splitlines()[-1] == said, r.stderr
    assert not (tmp_path / "dst").exists()


def test_memory_refused_under_an_address_space_limit_names_it(monkeypatch, capsys):
    """Under `ulimit -v` near the process's ~590 MB of mappings, the state's reserve (an
    mmap) failed: "Error: Cannot allocate memory", read as a file's error."""
    from fermijit.model import state

    def refused(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(state, "reserved", refused)
    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda which: (
        (585 << 20, resource.RLIM_INFINITY) if which == resource.RLIMIT_AS else real(which)))
    code, out, err = run_cli(monkeypatch, capsys, "generate", "def f", "--max-tokens", 2,
                             "--threads", 1)
    assert_one_line(code, err, "out of memory (limited to 585 MiB by ulimit -v)")


def test_a_closed_stdin_without_a_prompt_says_so():
    """`generate <&-` generated from an empty prompt without a word (as `>&-` is said)."""
    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "--max-tokens", "2",
                        "--threads", "1"], capture_output=True, timeout=300,
                       preexec_fn=lambda: os.close(0))
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "warning: standard input is closed: the prompt is empty" in err


def _wait_serving(proc, err_path, seconds: float = 180) -> None:
    """Until `serve` (proc, its stderr in err_path) says "serving on"; its log where it exits or
    takes longer."""
    deadline = time.monotonic() + seconds
    while "serving on" not in err_path.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
        time.sleep(0.1)


def test_serve_out_of_descriptors_says_so_once_and_recovers(tmp_path):
    """Under `ulimit -n 40` with 60 idle clients: asyncio logged a traceback per connection in
    the backlog, again after every one-second retry (1.4 million lines in 20 s), the event loop
    busy with it. Now one warning line; the server answers once the clients are gone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = open(tmp_path / "err", "w+")

    def limited():
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    proc = subprocess.Popen([sys.executable, "-m", "fermijit", "serve", "--port", str(port),
                             "--threads", "1", "--max-batch", "1", "--no-cache", "--prefill",
                             "cpu"], stdout=subprocess.DEVNULL, stderr=err, preexec_fn=limited)
    try:
        _wait_serving(proc, tmp_path / "err")
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(60)]
        time.sleep(2)
        for c in clients:
            c.close()
        _answers(port, timeout=30)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    text = (tmp_path / "err").read_text()
    assert "Traceback" not in text and text.count("cannot accept connections") == 1, text[-2000:]
    assert "Too many open files (ulimit -n 40); new clients wait until others close" in text


def test_an_accept_retry_after_the_stop_is_no_traceback(capsys, caplog):
    """asyncio, out of descriptors, retries accept() a second later (`_start_serving`); where the
    stop closed the socket meanwhile, the retry met descriptor -1 and the loop logged a ValueError's
    traceback (the test above, once). The server's handler (run.loop_errors) says nothing of that
    retry, and still logs any other callback's error."""
    import asyncio

    from fermijit.server import run

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(run.loop_errors())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    sock.close()

    def other():
        raise ValueError("another callback's error")

    try:
        loop.call_soon(loop._start_serving, lambda: None, sock)  # asyncio's retry, as it calls it
        loop.call_soon(loop.stop)
        loop.run_forever()
        assert "Exception in callback" not in caplog.text, caplog.text
        loop.call_soon(other)
        loop.call_soon(loop.stop)
        loop.run_forever()
    finally:
        loop.close()
    assert "another callback's error" in caplog.text
    assert capsys.readouterr().err == ""


def test_forced_cpu_features_this_cpu_lacks_are_refused():
    """NUMBA_CPU_FEATURES with a feature the CPU lacks (`+xop` on a Zen 5): LLVM vectorised with
    it (a rotate became XOP's vprotd) and `generate` died of SIGILL after "loaded", rc 132."""
    import llvmlite.binding as llvm

    known = llvm.get_host_cpu_features()
    lacking = next((f for f in ("xop", "fma4", "avx512fp16", "amx-tile", "avx512f")
                    if known.get(f) is False), None)
    if lacking is None:
        pytest.skip("this CPU has every feature tried")
    env = {**os.environ, "NUMBA_CPU_FEATURES": f"{known.flatten()},+{lacking}"}
    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "def f", "--max-tokens",
                        "2", "--threads", "1"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert_one_line(r.returncode, r.stderr, f"NUMBA_CPU_FEATURES asks for {lacking}, which "
                                            f"this CPU lacks")


def test_another_cpu_name_with_forced_features_is_refused():
    """NUMBA_CPU_NAME=bdver4 NUMBA_CPU_FEATURES=+ssse3: the features string adds to the named
    CPU's own, and LLVM vectorised with its XOP (a rotate's vprotd): SIGILL, rc 132."""
    import llvmlite.binding as llvm

    if llvm.get_host_cpu_name() == "bdver4":
        pytest.skip("this CPU is a bdver4")
    env = {**os.environ, "NUMBA_CPU_NAME": "bdver4", "NUMBA_CPU_FEATURES": "+ssse3"}
    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "def f", "--max-tokens",
                        "2", "--threads", "1"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert_one_line(r.returncode, r.stderr, "NUMBA_CPU_NAME bdver4 with NUMBA_CPU_FEATURES set: "
                                            "code gets bdver4's own features too")


def test_more_threads_than_allowed_cpus_says_why():
    """Under `taskset -c 0`, `--threads 2` said "--threads must be between 1 and 1"."""
    cpu = min(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "def f", "--max-tokens",
                        "2", "--threads", "2"], capture_output=True, text=True, timeout=300,
                       env=env, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    assert_one_line(r.returncode, r.stderr, "--threads must be between 1 and 1 (the CPUs this "
                                            "process may run on: taskset, cpuset or cgroup)")


def test_two_writers_of_one_output_directory(tmp_path, monkeypatch, capsys):
    """Two converts into one directory shared model.safetensors.partial: the second was told
    the first's was "left by a convert that was killed", or, started together, both wrote it
    and the loser's cleanup removed the winner's model. A writer holds a flock on the directory
    (here the test's own descriptor stands for the other process's)."""
    import fcntl

    src = tiny.write_checkpoint(tmp_path / "hf")
    dst = tmp_path / "out"
    dst.mkdir()
    other = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        code, _, err = run_cli(monkeypatch, capsys, "convert", src, dst)  # started together
        assert_one_line(code, err, f"output directory {dst} is being written by another "
                                   f"process")
        (dst / "model.safetensors.partial").write_bytes(b"being written")
        code, _, err = run_cli(monkeypatch, capsys, "convert", src, dst)  # started after
        assert_one_line(code, err, f"output directory {dst} is being written by another "
                                   f"process")
        assert (dst / "model.safetensors.partial").read_bytes() == b"being written"
    finally:
        os.close(other)
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, dst)  # its writer gone
    assert_one_line(code, err, "left by a convert that was killed")
    (dst / "model.safetensors.partial").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, dst)
    assert code == 0 and (dst / "fermijit.json").is_file(), err


@pytest.mark.parametrize("name, value, message", [
    # libgomp: two lines of its own, then its default; and DEFAULT_SPIN was left unset
    ("OMP_WAIT_POLICY", "garbage", "OMP_WAIT_POLICY must be active or passive, got 'garbage'"),
    ("GOMP_SPINCOUNT", "lots", "GOMP_SPINCOUNT must be a whole number of spins"),
    ("GOMP_SPINCOUNT", "10x", "GOMP_SPINCOUNT must be a whole number of spins"),
])
def test_openmp_settings_libgomp_ignores_are_one_line(name, value, message):
    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "def f", "--max-tokens",
                        "2", "--threads", "1"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, name: value})
    assert_one_line(r.returncode, r.stderr, message)


@pytest.mark.parametrize("name, value", [("OMP_WAIT_POLICY", " Passive "),
                                         ("GOMP_SPINCOUNT", "10k"), ("GOMP_SPINCOUNT", "INFINITE"),
                                         ("GOMP_SPINCOUNT", "3000")])
def test_openmp_settings_libgomp_takes_are_taken(name, value):
    r = subprocess.run([sys.executable, "-c", "import fermijit.jit.cpu"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, name: value})
    assert r.returncode == 0 and r.stderr == "", r.stderr


def _rewrite_in_place(path) -> None:
    """The second half of `path`'s bytes changed, its size kept (no SIGBUS: new bytes)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        data = f.read()
        f.seek(size // 2)
        f.write(bytes(b ^ 0x5A for b in data))


def test_weights_rewritten_in_place_under_serve_fail_its_requests(tmp_path):
    """A weights file rewritten in place (its size kept) under a running server: greedy "ash\\n\\n
    The `fractions` module" became "", a 200, without a word. A file replaced by rename stays
    fine (the mapping reads the old inode, whole)."""
    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = open(tmp_path / "err", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "fermijit", "serve", "--model", str(model),
                             "--port", str(port), "--threads", "1", "--max-batch", "1",
                             "--no-cache", "--prefill", "cpu"], stdout=subprocess.DEVNULL,
                            stderr=err)

    def complete():
        body = json.dumps({"prompt": "def f", "max_tokens": 6, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())["choices"][0]["text"]
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]["message"]

    try:
        _wait_serving(proc, tmp_path / "err")
        weights = model / "model.safetensors"
        before = complete()
        assert before[0] == 200 and before[1], before
        os.link(weights, tmp_path / "mapped")  # the inode served, whatever the name holds
        shutil.copyfile(weights, tmp_path / "new")
        _rewrite_in_place(tmp_path / "new")
        os.replace(tmp_path / "new", weights)  # replaced by rename: still the old answers
        assert complete() == before
        _rewrite_in_place(tmp_path / "mapped")
        code, message = complete()
        assert code == 503 and "changed while mapped (rewritten in place" in message, message
        assert complete()[0] == 503
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    said = [line for line in (tmp_path / "err").read_text().splitlines() if "Error" in line]
    assert len(said) == 1 and said[0].endswith("replace model files by rename): restart the "
                                               "server"), said


def test_weights_rewritten_in_place_under_generate_is_said(tmp_path, monkeypatch, capsys):
    """generate's text came from a mix of two files without a word; the next run, loading the
    file changed again, is the new file's and not refused by the old watch."""
    from fermijit.engine import Engine

    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, model)
    real = Engine.generate

    def then_rewritten(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        _rewrite_in_place(model / "model.safetensors")
        return result

    monkeypatch.setattr(Engine, "generate", then_rewritten)
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--model", model, "def f",
                             "--max-tokens", 2, "--threads", 1)
    assert_one_line(code, err, f"{model}/model.safetensors changed while mapped (rewritten in "
                               f"place since it was loaded")
    monkeypatch.setattr(Engine, "generate", real)
    _rewrite_in_place(model / "model.safetensors")  # the bytes back, a new mtime
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--model", model, "def f",
                             "--max-tokens", 2, "--threads", 1, "--no-cache")
    assert code == 0, err


def test_a_model_directory_named_in_bytes_not_utf8(tmp_path):
    """A directory name that is not UTF-8 (Latin-1 bytes, held by Python as lone surrogates):
    every model command failed with "not a readable tokenizer ('utf-8' codec can't encode
    characters ...)" (the tokenizer library takes its path as text), and serve's JSON naming
    the model with a 500 and a traceback."""
    from fermijit.server.run import model_name

    model = tmp_path / os.fsdecode(b"mod\xe8le")
    shutil.copytree(DEFAULT_MODEL, model)
    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "--model", str(model),
                        "def f", "--max-tokens", "2", "--threads", "1"], capture_output=True,
                       timeout=300)  # a subprocess: its stderr writes such a path escaped
    assert r.returncode == 0 and r.stdout, r.stderr.decode()
    assert model_name(model) == "mod\ufffdle"
    json.dumps(model_name(model), ensure_ascii=False).encode()  # no surrogates left


def test_no_home_is_one_line(tmp_path, monkeypatch, capsys):
    """A container run as a uid with no passwd entry and no HOME: `--model x.gguf` died of
    Path.home()'s RuntimeError, a traceback. Now the cache asks for FERMIJIT_CACHE (and an
    HF checkpoint's hashing just goes unrecorded)."""
    from pathlib import Path

    from fermijit.model import data_hash

    pytest.importorskip("gguf")
    gguf = tmp_path / "m.gguf"
    assert run_cli(monkeypatch, capsys, "export", DEFAULT_MODEL, gguf)[0] == 0
    for name in ("HOME", "XDG_CACHE_HOME", "FERMIJIT_CACHE"):
        monkeypatch.delenv(name, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--model", gguf, "def f",
                           "--max-tokens", 2, "--threads", 1)
    assert_one_line(code, err, "no folder for fermijit's cache: HOME is not set and this user "
                               "has no home directory (set FERMIJIT_CACHE)")
    assert len(data_hash.file_sha256(gguf)) == 64


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    """XDG_CACHE_HOME=cache made the caches folders of whatever the working directory was (the
    XDG spec has a relative path ignored)."""
    from fermijit import user_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    assert user_cache_dir() == tmp_path / ".cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg"


@pytest.mark.parametrize("suffix, size", [(".nbi", 0), (".nbc", 100)])
def test_a_damaged_kernel_cache_file_compiles_again(tmp_path, suffix, size):
    """An index or data file of Numba's cache cut short (Numba never fsyncs: a crash leaves
    empty files behind its renames): pickle's UnpicklingError / EOFError out of every run's
    first kernel, a traceback, until the folder was cleared by hand."""
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    def run():
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 0 and r.stdout == "42 2.5\n", r.stderr
        return r.stderr

    assert run() == ""
    damaged = list((tmp_path / "numba").rglob("*" + suffix))
    assert damaged
    for path in damaged:
        os.truncate(path, size)
    said = run()
    assert said.count("\n") == 1 and "fermijit: a damaged kernel cache file in" in said, said
    assert run() == ""  # written anew


def test_a_full_stderr_loses_only_the_diagnostics():
    """`generate 2>/dev/full`: the "loaded" line's ENOSPC ended the run, no text and exit 2
    (its one line lost too)."""
    args = [sys.executable, "-m", "fermijit", "generate", "def f", "--max-tokens", "4",
            "--temperature", "0", "--threads", "1"]
    expected = subprocess.run(args, capture_output=True, timeout=300).stdout
    with open("/dev/full", "wb") as full:
        r = subprocess.run(args, stdout=subprocess.PIPE, stderr=full, timeout=300)
    assert r.returncode == 0 and r.stdout == expected and expected


def test_serve_outlives_its_log_reader(tmp_path):
    """`serve 2>&1 | tee log` with tee gone: the next line on stderr raised BrokenPipeError out
    of whatever printed it (the start's "ready" line closed the port and left the process
    alive; Ctrl-C's "stopped", exit 1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "fermijit", "serve", "--port", str(port),
                             "--threads", "1", "--max-batch", "1", "--no-cache", "--prefill",
                             "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    said = b""
    try:
        deadline = time.monotonic() + 180
        while b"serving on" not in said:
            assert proc.poll() is None and time.monotonic() < deadline, said
            said += os.read(proc.stderr.fileno(), 4096)
        proc.stderr.close()  # the log's reader gone
        for _ in range(2):
            _answers(port, timeout=60)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_memory_cgroups_below_the_root_and_v1_are_read(tmp_path):
    """Only cgroup v2's limit at the mount's root was read: a limit on a group below it
    (`systemd-run -p MemoryMax=2G`) or cgroup v1's (an older Docker host) was missed, and a
    context or cache sized by the host's memory met the OOM killer (SIGKILL, no word)."""
    from fermijit.model.state import cgroup_room

    def write(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    membership = tmp_path / "cgroup"
    membership.write_text("0::/system.slice/run-1.scope\n")
    root = tmp_path / "v2"
    write(root / "system.slice/memory.max", "max\n")
    write(root / "system.slice/run-1.scope/memory.max", f"{2 << 30}\n")
    write(root / "system.slice/run-1.scope/memory.current", f"{1 << 30}\n")
    assert cgroup_room(root, membership) == 1 << 30
    membership.write_text("4:memory:/docker/abc\n0::/\n")
    root = tmp_path / "v1"
    write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "memory/memory.usage_in_bytes", f"{5 << 30}\n")
    write(root / "memory/docker/memory.limit_in_bytes", f"{3 << 30}\n")
    write(root / "memory/docker/memory.usage_in_bytes", f"{1 << 30}\n")
    assert cgroup_room(root, membership) == 2 << 30  # the parent's limit, the least
    assert cgroup_room(tmp_path / "none", membership) is None


def _answers(port: int, timeout: float) -> None:
    """A short completion from the server on `port` is a 200."""
    body = json.dumps({"prompt": "def f", "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        assert r.status == 200


@pytest.mark.parametrize("package", ["llvmlite", "click"])
def test_a_python_without_the_dependencies_says_which(tmp_path, package):
    """`python -m fermijit info` from a checkout by a Python fermijit was not installed into:
    the import's traceback (llvmlite absent), now one line naming the package and the Python."""
    shadow = tmp_path / package
    shadow.mkdir()
    (shadow / "__init__.py").write_text(
        f"raise ModuleNotFoundError('absent', name={package!r})\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root])}
    r = subprocess.run([sys.executable, "-m", "fermijit", "info"], capture_output=True,
                       text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"Error: the package {package!r} is not installed for "
                                f"{sys.executable}: install fermijit into it (pip install -e .) "
                                "or run the Python it is installed in"), r.stderr
