"""fermijit.jit.omp: one OpenMP fork per launch."""

import itertools
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

from fermijit.jit import omp
from fermijit.jit.cpu import kernel


def _python(args, timeout=600, **env):
    """A fresh interpreter on `args` with `env` added; its stdout (it must exit 0)."""
    r = subprocess.run([sys.executable, *args], env=dict(os.environ, **env), capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _record(thread, n_threads, args):
    (seen,) = args
    seen[thread] = n_threads


def _launch(seen):
    fork((seen,))


_TEAM = "omp" if omp.available() else "serial"
record_threads = kernel(_launch, fork=omp.fork(_record), variant=_TEAM)


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_each_thread_of_the_team_runs_its_share_once():
    full = numba.get_num_threads()
    try:
        for n in sorted({1, full}):
            numba.set_num_threads(n)
            seen = np.full(numba.config.NUMBA_NUM_THREADS + 1, -1)
            record_threads(seen)
            assert seen[:n].tolist() == [n] * n     # thread t of n wrote n, once
            assert (seen[n:] == -1).all()          # no thread beyond the team
    finally:
        numba.set_num_threads(full)


def _launch_capped(cap, seen):
    fork(cap, (seen,))


record_capped = kernel(_launch_capped, fork=omp.fork(_record, capped=True), variant=_TEAM)


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_a_capped_fork_runs_a_team_of_at_most_its_cap_and_at_least_one():
    full = numba.get_num_threads()
    cases = [(0, 1), (1, 1), (full, full), (full + 5, full)] + [(full - 1, full - 1)] * (full > 1)
    for cap, team in cases:
        seen = np.full(numba.config.NUMBA_NUM_THREADS + 1, -1)
        record_capped(cap, seen)
        assert seen[:team].tolist() == [team] * team
        assert (seen[team:] == -1).all()


KEEPS_THREADS = textwrap.dedent("""
    import os
    import numba
    import numpy as np
    from fermijit.jit import omp
    from fermijit.jit.cpu import kernel
    from tests.fermijit.jit.test_omp import _launch_capped, _launch, _record
    omp.available()
    numba.set_num_threads(4)            # over fermijit's default of the physical cores
    capped = kernel(_launch_capped, fork=omp.fork(_record, capped=True), variant="omp")
    whole = kernel(_launch, fork=omp.fork(_record), variant="omp")
    seen = np.full(8, -1)
    whole(seen)
    ids = set(os.listdir("/proc/self/task"))
    for _ in range(50):
        capped(2, seen)
        whole(seen)
        ids |= set(os.listdir("/proc/self/task"))
    print(len(ids) - len(os.listdir("/proc/self/task")))
""")


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_a_capped_fork_keeps_the_pools_threads():
    """libgomp ends the pool threads a smaller team leaves out; the next whole team creates them
    again (~300 us a fork of 16 threads). A capped fork of 2 between whole forks of 4 threads: no
    thread ever ended (the old capped team made 2 new threads a pair of forks)."""
    assert int(_python(["-c", KEEPS_THREADS], NUMBA_NUM_THREADS="4")) == 0


@numba.extending.intrinsic
def _owner_of(typingctx, ary):
    """The meminfo pointer of an array, as an int."""
    def codegen(context, builder, sig, args):
        meminfo = context.make_array(sig.args[0])(context, builder, args[0]).meminfo
        return builder.ptrtoint(meminfo, context.get_value_type(numba.types.intp))

    return numba.types.intp(ary), codegen


def _owners(thread, n_threads, args):
    seen, (data, other) = args
    view = data[1:]                                      # a view, and one of a nested tuple's
    seen[thread, 0] = _owner_of(seen) + _owner_of(view) + _owner_of(other[::2])
    view[thread] = thread + 1                            # writes go through as before


def _launch_owners(seen, data, other):
    fork((seen, (data, other)))


owners_in_shares = kernel(_launch_owners, fork=omp.fork(_owners), variant=_TEAM)


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_shares_see_arrays_without_an_owner_so_views_count_no_references():
    """Each view counted a reference on its array's meminfo, an atomic add on a line every
    thread shares; a share's arrays (nested ones too) come without one, and work as before."""
    n = numba.get_num_threads()
    seen = np.full((n, 1), -1, dtype=np.intp)
    data = np.zeros(n + 1)
    owners_in_shares(seen, data, np.ones(4))
    assert (seen == 0).all()
    assert data[1:].tolist() == [t + 1 for t in range(n)]


CACHED = textwrap.dedent("""
    import numba
    import numpy as np
    from fermijit.jit import omp
    from fermijit.jit.cpu import kernel

    def _share(thread, n_threads, args):
        (out,) = args
        out[thread] = thread + 1

    def _launch(out):
        fork((out,))

    f = kernel(_launch, fork=omp.fork(_share), variant=str(omp.available()))
    out = np.zeros(numba.config.NUMBA_NUM_THREADS, np.int64)
    f(out)
    n = numba.get_num_threads() if omp.available() else 1
    print(int(out.sum()) == n * (n + 1) // 2, sum(f.stats.cache_hits.values()))
""")


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_a_forking_kernel_loads_from_the_cache(tmp_path):
    """The cached object calls libgomp: a fresh process must link it (not crash, not miss)."""
    (tmp_path / "forker.py").write_text(CACHED)
    path = os.pathsep.join([str(tmp_path), *sys.path])

    def run():
        return tuple(_python([str(tmp_path / "forker.py")], timeout=300, PYTHONPATH=path).split())

    assert run() == ("True", "0")   # every thread ran its share; compiled
    assert run() == ("True", "1")   # the same, loaded from the cache


WITHOUT_OMP = textwrap.dedent("""
    import numpy as np
    from fermijit.jit import omp
    from fermijit.ops import matvec, quant
    rng = np.random.default_rng(3)
    qs, d = quant.quantize_q4_0(rng.standard_normal((37, 96)).astype(np.float32))
    x = rng.standard_normal(96).astype(np.float32)
    y, ref = matvec.cpu(qs, d, x), matvec.reference(qs, d, x)
    print(omp.available(), float(np.abs(y - ref).max() / np.abs(ref).max()))
""")


def test_without_the_omp_layer_products_run_as_a_team_of_one(tmp_path):
    """Where Numba's threading layer is not omp, `fork` must not call libgomp (a second pool of
    threads): the products still run, correctly, on the calling thread."""
    available, err = _python(["-c", WITHOUT_OMP], NUMBA_THREADING_LAYER="workqueue",
                             NUMBA_CACHE_DIR=str(tmp_path)).split()
    assert available == "False" and float(err) < 1e-5


ODD_TEAM = textwrap.dedent("""
    import numpy as np
    from fermijit.jit import omp
    from fermijit.ops import matvec, quant
    assert omp.available()
    rng = np.random.default_rng(5)
    errs = []
    for rows, n_tok in ((1, 1), (2, 1), (7, 1), (37, 1), (37, 6), (5, 9)):
        qs, d = quant.quantize_q4_0(rng.standard_normal((rows, 96)).astype(np.float32))
        x = rng.standard_normal((n_tok, 96)).astype(np.float32)
        ref = matvec.reference(qs, d, x)
        errs.append(float(np.abs(matvec.cpu(qs, d, x) - ref).max() / np.abs(ref).max()))
    qs, d = quant.quantize_q4_0(rng.standard_normal((5 * 11, 64)).astype(np.float32))
    qs, d = qs.reshape(5, 11, -1), d.reshape(5, 11, -1)
    idx = np.array([4, 0, 2], np.int32)
    x = rng.standard_normal(64).astype(np.float32)
    ref = matvec.gathered_reference(qs, d, idx, x)
    errs.append(float(np.abs(matvec.gathered_cpu(qs, d, idx, x) - ref).max() / np.abs(ref).max()))
    print(max(errs))
""")


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_a_team_larger_than_the_machine_splits_rows_exactly():
    """Three threads (more than this machine's cores, an odd count): every row of every product
    computed once, for row counts below, at and above the team size."""
    assert float(_python(["-c", ODD_TEAM], NUMBA_NUM_THREADS="3")) < 1e-5


FORKED = textwrap.dedent("""
    import os
    import numpy as np
    from fermijit import FermijitError
    from fermijit.ops import matvec
    qs, d = np.zeros((4, 16), np.uint8), np.zeros((4, 1), np.float16)
    matvec.cpu(qs, d, np.ones(32, np.float32))          # the parent uses the kernels
    pid = os.fork()
    if pid == 0:
        try:
            matvec.cpu(qs, d, np.ones(32, np.float32))
        except FermijitError as e:
            print("refused:", e, flush=True)
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status))
""")


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_a_forked_child_is_refused_not_hung():
    """libgomp's threads do not survive fork(): a child of a process that used the kernels gets
    a one-line error (and would hang in libgomp without it)."""
    out = _python(["-c", FORKED], timeout=120)
    assert "refused:" in out and "spawn" in out and "child exit 0" in out


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_regions_count_their_launches_and_split_their_time():
    seen = np.full(numba.config.NUMBA_NUM_THREADS + 1, -1)
    record_threads(seen)  # compiled before counting
    omp.Regions.start()
    for _ in range(7):
        record_threads(seen)
    r = omp.Regions.stop()
    assert r.count == 7
    assert r.wall_s >= r.share_max_s >= r.busy_mean_s > 0
    assert r.idle_s >= 0 and r.fork_join_s >= 0
    n = numba.get_num_threads()
    assert r.busy_s == pytest.approx(n * r.busy_mean_s, rel=1e-3, abs=1e-7)
    record_threads(seen)
    assert omp.Regions.stop().count == 7  # stopped: later launches are not counted
    assert (omp.Regions.now() - r).count == 0


def test_idle_threads_spin_briefly_unless_the_user_chose():
    """libgomp reads GOMP_SPINCOUNT when Numba first launches its threads: by then fermijit has
    set its short default, and leaves a spin or a wait policy the user gave alone."""
    script = textwrap.dedent("""
        import os
        from fermijit.jit import cpu, omp
        omp.available()
        loaded = any("libgomp" in line for line in open("/proc/self/maps"))
        print(os.environ.get("GOMP_SPINCOUNT"), loaded)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}

    def run(**extra):
        r = subprocess.run([sys.executable, "-c", script], env=dict(env, **extra),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split()

    from fermijit.jit import cpu
    spin, loaded = run()
    assert spin == cpu.DEFAULT_SPIN and int(spin) < 300000
    if loaded == "True":  # the omp layer: libgomp was loaded after the variable was set
        assert run(GOMP_SPINCOUNT="12345")[0] == "12345"
    assert run(OMP_WAIT_POLICY="active")[0] == "None"


def _cover(thread, n_threads, args, counter):
    """Each unit of every run the thread claims: counted once more (NaN: never before)."""
    out, owner, runs, n, least, step = args
    first, last = omp.first_run(counter, thread, n_threads, n, least, step)
    while first < last:
        runs[thread] += 1
        for u in range(first, last):
            out[u] = 1.0 if np.isnan(out[u]) else out[u] + 1.0
            owner[u] = thread
        first, last = omp.next_run(counter, thread, n_threads, n, least, step)


def _launch_cover(out, owner, runs, n, least, step):
    fork((out, owner, runs, n, least, step))


cover_units = kernel(_launch_cover, fork=omp.fork(_cover, chunked=True), variant=_TEAM)


def check_cover(team: int, from_team: int = 1) -> int:
    """Chunked shares of ragged unit counts, least run lengths, steps and static parts on the
    current team (`team` threads), claims from teams of `from_team`: every unit taken exactly once
    (outputs NaN-poisoned): the static part's as its equal runs, the rest claimed in runs of whole
    steps (but the last) of at least `least` units; or (omp.set_dynamic(False), or a team under
    `from_team`) all as the static equal runs. Returns the most runs a launch took (more than the
    team: claimed)."""
    most = 0
    for n, percent in itertools.product((0, 1, 2, 5, 16, 37, 1000, 4099), (0, 50, 90)):
        for least, step in ((1, 1), (3, 2), (7, 3), (64, 1)):
            for dynamic in (True, False):
                previous = omp.set_dynamic(dynamic, static_percent=percent, from_team=from_team)
                out, owner = np.full(n, np.nan), np.full(n, -1, np.int64)
                runs = np.zeros(numba.config.NUMBA_NUM_THREADS, np.int64)
                try:
                    cover_units(out, owner, runs, n, least, step)
                finally:
                    omp.set_dynamic(*previous)
                where = (f"n {n}, least {least}, step {step}, dynamic {dynamic} (static "
                         f"{percent} %), team {team}")
                assert (out == 1.0).all(), where
                assert ((owner >= 0) & (owner < team)).all(), where
                # the static equal runs of the first `static` units (all without claims)
                claims = dynamic and team >= max(2, from_team)
                static = n if not claims else n * percent // 100
                want = np.repeat(np.arange(team), np.diff([t * static // team
                                                           for t in range(team + 1)]))
                np.testing.assert_array_equal(owner[:static], want, err_msg=where)
                if static < n:
                    pool = owner[static:]
                    starts = np.flatnonzero(np.diff(pool, prepend=-1))
                    lengths = np.diff(np.append(starts, pool.size))
                    # a run may continue a run of the same thread: whole runs are still whole
                    # steps and at least `least` long, but for the last (the units left)
                    assert (lengths[:-1] % step == 0).all() and (lengths[:-1] >= least).all(), \
                        where
                    most = max(most, int(runs.sum()))
    return most


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_a_chunked_share_claims_every_unit_exactly_once():
    full = numba.get_num_threads()
    try:
        for team in sorted({1, 2, full}):
            numba.set_num_threads(team)
            most = check_cover(team)
            assert team == 1 or most > team  # runs claimed dynamically, not one a thread
            # a team smaller than the schedule's from_team (decode's default: CLAIMS_FROM_TEAM)
            # takes the static equal runs: one a thread
            assert check_cover(team, from_team=team + 1) <= team
    finally:
        numba.set_num_threads(full)


CHUNKED_TEAMS = textwrap.dedent("""
    import numba
    import numpy as np
    from tests.fermijit.jit.test_omp import check_cover
    from fermijit.jit import omp
    from fermijit.ops import attention, fp32_rows, kv_quant, matvec, moe, quant

    def q4(rng, shape):
        return quant.quantize_q4_0(rng.standard_normal(shape).astype(np.float32) * 0.3)

    def q8(rng, shape):
        return quant.quantize_q8_0(rng.standard_normal(shape).astype(np.float32))

    rng = np.random.default_rng(29)
    # Ragged rows, long enough to be many runs of at least omp.CHUNK_BYTES each.
    qs, d = q4(rng, (3001, 256))
    w = matvec.Q4Matrix.of(qs, d)
    q8s, q8d = q8(rng, (2999, 256))
    gqs, gd = q4(rng, (16, 1001, 256))
    sqs, sd = q4(rng, (1, 1001, 256))
    idx = np.array([5, 0, 11, 3, 15, 7, 9, 2], np.int32)
    x1 = rng.standard_normal((1, 256)).astype(np.float32)
    x2 = rng.standard_normal((2, 256)).astype(np.float32)
    w_rows = rng.standard_normal((37, 256)).astype(np.float32)
    w_fp32 = rng.standard_normal((1003, 256)).astype(np.float32)
    hid, inter, e = 2048, 128, 16
    mw = moe.MoeWeights(*q4(rng, (e, 2 * inter, hid)), *q4(rng, (e, hid, inter)),
                        *q4(rng, (1, 2 * inter, hid)), *q4(rng, (1, hid, inter)),
                        rng.standard_normal(hid).astype(np.float32) * 0.1)
    xm = rng.standard_normal((1, hid)).astype(np.float32)
    ids = idx[None]
    wts = rng.uniform(0.05, 1, (1, 8)).astype(np.float32)
    wts /= wts.sum()
    # Attention over a Q8_0 cache: a decode query at 5000 keys (20 key ranges x 2 kv heads, items
    # claimed), a 60-query pass (tiles of queries) at 2000.
    aq, agate = (rng.standard_normal((60, 8, 64)).astype(np.float32) for _ in range(2))
    ak, av = (kv_quant.reference(rng.standard_normal((2, 5001, 64)).astype(np.float32))
              for _ in range(2))

    def products():
        out = {}
        act1, act2 = matvec.quantize_act(x1), matvec.quantize_act(x2, matvec.decode_isa())
        out["gemv"] = matvec.product(w, act1, np.full(3001, np.nan, np.float32))
        out["few"] = matvec.product(w, act2, np.full((2, 3001), np.nan, np.float32),
                                    like_gemv=True)
        out["q8"] = matvec.q8_cpu(q8s, q8d, act1, np.full(2999, np.nan, np.float32))
        out["gathered"] = matvec.gathered_cpu(gqs, gd, idx, act1, np.full((9, 1001), np.nan,
                                              np.float32), shared=(sqs, sd))
        y, p = np.full((1, 3001), np.nan, np.float32), np.full((1, 37), np.nan, np.float32)
        kernel_, args = matvec.launch_with_rows(w, act1, y, x1, w_rows, p)
        kernel_(*args)
        out["gemv_rows"], out["rows"] = y, p
        out["fp32"] = np.full((2, 1003), np.nan, np.float32)
        fp32_rows.decode_rows()(x2, w_fp32, out["fp32"])
        out["moe"] = moe.cpu(xm, ids, wts, mw, np.full((1, hid), np.nan, np.float32),
                             moe.Scratch.make(mw, 8))
        out["attention decode"] = attention.cpu(aq[:1], ak, av, agate[:1], 5000)
        out["attention pass"] = attention.cpu(aq, ak, av, agate, 2000)
        return out

    full = numba.get_num_threads()
    numba.set_num_threads(1)
    want = products()
    assert all(not np.isnan(v).any() for v in want.values())
    for team in range(1, full + 1):
        numba.set_num_threads(team)
        assert team == 1 or check_cover(team) > team
        for dynamic, percent in ((True, 0), (True, 50), (False, 50)):
            omp.set_dynamic(dynamic, static_percent=percent, from_team=1)
            for name, got in products().items():
                np.testing.assert_array_equal(got, want[name], err_msg=f"{name}, team {team}, "
                                              f"dynamic {dynamic}, static {percent} %")
    print("ok")
""")


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_chunked_shares_cover_every_row_once_on_teams_larger_than_the_machine():
    """Teams of 1 to 5 threads (more than this machine's cores): every unit of a chunked share
    claimed once, and decode's chunked products (GEMV, few tokens, Q8_0 head, gathered experts,
    GEMV with fp32 rows, fp32 rows, the fused MoE, attention's items: a decode query's key
    ranges, a pass's tiles) every output the one-thread bits, dynamic or static."""
    assert _python(["-c", CHUNKED_TEAMS], NUMBA_NUM_THREADS="5").strip() == "ok"


def _prefill_cover(thread, n_threads, args, counter):
    """Each item of every prefill run the thread takes: counted once more; its runs counted."""
    out, runs, n = args
    first, last = omp.prefill_first(counter, thread, n_threads, n)
    while first < last:
        runs[thread] += 1
        for u in range(first, last):
            out[u] = 1.0 if np.isnan(out[u]) else out[u] + 1.0
        first, last = omp.prefill_next(counter, thread, n_threads, n)


def _launch_prefill_cover(out, runs, n):
    fork((out, runs, n))


prefill_cover = kernel(_launch_prefill_cover, fork=omp.fork(_prefill_cover, chunked=True),
                       variant=_TEAM)


def test_prefill_runs_and_their_switch():
    """Prefill's GEMMs cut n items into FINE units a thread (at most n, at least one) and claim
    runs of them: every item once, more runs than threads where there are more items than
    threads; unless FERMIJIT_PREFILL_CLAIM=0 (read at import) or set_prefill_claim(False) says
    not: then one static equal run a thread (ops/gemm.py; the bits: tests/ops/test_gemm.py)."""
    assert omp.fine_units(10_000, 3) == 3 * omp.FINE
    assert omp.fine_units(5, 16) == 5 and omp.fine_units(0, 4) == 1
    team = numba.get_num_threads() if omp.available() else 1
    previous = omp.set_prefill_claim(True)
    try:
        for claim in (True, False):
            omp.set_prefill_claim(claim)
            for n in (0, 1, 3, 37, 4099, 100_000):
                out, runs = np.full(n, np.nan), np.zeros(numba.config.NUMBA_NUM_THREADS, np.int64)
                prefill_cover(out, runs, n)
                assert (out == 1.0).all(), (claim, n)
                if not claim or team == 1:
                    assert runs.sum() == min(n, team), (claim, n)
                elif n > team:
                    assert runs.sum() > team, (claim, n)
    finally:
        omp.set_prefill_claim(previous)
    code = "from fermijit.jit import omp; print(bool(omp._schedule[omp.CLAIM_PREFILL_WORD]))"
    assert _python(["-c", code], FERMIJIT_CLAIMS_FROM_TEAM="99").strip() == "True"
    assert _python(["-c", code], FERMIJIT_PREFILL_CLAIM="0").strip() == "False"
    assert _python(["-c", code], FERMIJIT_PREFILL_CLAIM="1").strip() == "True"


def test_claims_from_team_setting():
    """Decode's shares claim in teams of CLAIMS_FROM_TEAM threads or more, FERMIJIT_CLAIMS_FROM_TEAM
    (read at import) where set; junk there is a one-line error, not a traceback (the claims'
    runs in teams under and over the setting: check_cover above)."""
    code = "from fermijit.jit import omp; print(omp._schedule[omp.TEAM_WORD])"
    assert int(_python(["-c", code])) == omp.CLAIMS_FROM_TEAM
    assert int(_python(["-c", code], FERMIJIT_CLAIMS_FROM_TEAM="5")) == 5
    assert int(_python(["-c", code], FERMIJIT_CLAIMS_FROM_TEAM="0")) == 1
    r = subprocess.run([sys.executable, "-m", "fermijit", "info"], capture_output=True, text=True,
                       env=dict(os.environ, FERMIJIT_CLAIMS_FROM_TEAM="lots"), timeout=600)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "Error: FERMIJIT_CLAIMS_FROM_TEAM must be a whole number >= 0, got 'lots'"]
