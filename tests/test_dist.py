"""Data parallel on CPU (gloo, 2 processes under torchrun): 2 ranks x batch B train the same model
as 1 rank x batch 2B; rank 0 alone writes; kill -9 of the launcher then --resume is exact; a
signal to one rank stops all cleanly; a dead rank ends the run; bad set-ups exit 2 writing nothing.

Each torchrun costs seconds of start-up (a launcher and two ranks importing torch on a 2-core CI
machine), so the runs that several tests check are module fixtures, runs that need no process of
their own (the one-process references, a resume on another world size) run in the test process, and
the launchers (torchrun's entry point, ``streamnmt train --nproc``) run in forked children of the test
process, its imports paid; the ranks are fresh processes as ever.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from streamnmt.cli import main
from streamnmt.training.runs import read_csv
from tests.conftest import Forked, in_child, single_thread
from tests.test_accum import TINY, assert_same_training

STEPS = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("home"))


def env_for(home: str, **extra: str) -> dict[str, str]:
    return dict(os.environ, STREAMNMT_HOME=home, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1",
                **extra)


def torchrun(args: list[str], home: str, env: dict | None = None, wait: bool = True):
    """``torchrun --nproc-per-node 2 -m streamnmt train ARGS`` on a free port (torchrun's own entry
    point in a forked child of the test process: :func:`launch`)."""
    argv = ["--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "streamnmt", "train", *args]
    return launch(torchrun_main(argv), home, env, wait)


def torchrun_main(argv: list[str]) -> Callable[[], int]:
    """What ``python -m torch.distributed.run ARGV`` runs."""
    def run() -> int:
        from torch.distributed.run import main as torchrun_entry
        torchrun_entry(argv)
        return 0
    return run


def streamnmt(args: list[str], home: str, env: dict | None = None, wait: bool = True):
    """``streamnmt train ARGS`` (with --nproc: the launcher, which runs torchrun in its process)."""
    def run() -> int:
        with single_thread():  # as a fresh process under OMP_NUM_THREADS=1
            return main(["train", *args])
    return launch(run, home, env, wait)


def launch(what: list[str] | Callable[[], int], home: str, env: dict | None, wait: bool):
    """A command (a fresh process) or a function run in a forked child of the test process
    (:class:`Forked`: a launcher's start-up, seconds before its ranks start theirs, paid once by the
    test process), in a session of its own; with ``wait``, its end as a ``CompletedProcess``. Nothing
    it started outlives the test."""
    full_env = env_for(home, **(env or {}))
    if isinstance(what, list):
        proc = subprocess.Popen(what, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    else:
        proc = Forked(what, full_env)
    if not wait:
        return proc
    try:
        out, err = proc.communicate(timeout=300)
    finally:  # nothing it started outlives the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(what, proc.returncode, out, err)


# A --data copy of the built-in corpus trains as the built-in corpus does: the corpus rule would raise the
# label smoothing for its Chinese target (streamnmt.config.corpus_label_smoothing) and train fewer pieces per
# character of it (streamnmt.data.config.SMALL_CORPUS_PIECES_PER_CHARACTER); a built-in run keeps 0.1 and
# asks 32,000 pieces a side (streamnmt.data.config.CORPUS_VOCAB).
AS_BUILTIN = ["--label-smoothing", "0.1", "--src-vocab", "32000", "--tgt-vocab", "32000"]


def common(tmp: Path, strategy: str = "full") -> list[str]:
    return [*TINY, "--max-steps", str(STEPS), "--sync-strategy", strategy, "--project", str(tmp)]


@pytest.fixture(scope="module")
def two_ranks_run(tmp_path_factory, home) -> tuple[Path, subprocess.CompletedProcess]:
    """The reference 2-rank run (batch 8 per rank, a checkpoint every 10 steps) and its output. It
    asks for --sync-strategy graph, which is unavailable on the CPU: the ranks agree to run full (the
    graph test checks that), so this is the full strategy's 2-rank run too."""
    tmp = tmp_path_factory.mktemp("ddp")
    res = torchrun([*common(tmp, "graph"), "--batch-size", "8", "--save-every", "10", "--keep-last", "2",
                    "--name", "ref"], home)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / "ref", res


@pytest.fixture(scope="module")
def two_ranks(two_ranks_run) -> Path:
    return two_ranks_run[0]


def one_rank(tmp: Path, home: str, strategy: str) -> Path:
    """The 1-rank x batch 16 run of ``strategy``, in the test process."""
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("STREAMNMT_HOME", home)
        assert main(["train", *common(tmp, strategy), "--batch-size", "16", "--name", "one"]) == 0
    return tmp / "one"


@pytest.fixture(scope="module")
def one_rank_full(tmp_path_factory, home) -> Path:
    """The 1-rank full run that 2 ranks of half the batch match, with and without accumulation."""
    return one_rank(tmp_path_factory.mktemp("one"), home, "full")


@pytest.fixture(scope="module")
def fresh_corpus_run(tmp_path_factory, home) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """2 ranks x 2 micro-batches of 4 (--accum-steps 2) on a corpus directory without tokenizers or
    cache that holds the built-in corpus of 500 pairs: (the run, the corpus, the output). Its
    training is checked against one rank's, its preparation against one process's."""
    from streamnmt.data import synthetic

    tmp = tmp_path_factory.mktemp("fresh")
    corpus = tmp / "corpus"
    synthetic.write_builtin(corpus, 500, seed=0)  # the built-in corpus the one-rank reference trains on
    res = torchrun([*common(tmp), "--batch-size", "4", "--accum-steps", "2", "--data", str(corpus), "--name", "two",
                    *AS_BUILTIN], home)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / "two", corpus, res


def rank_processes(launcher: Forked) -> dict[int, psutil.Process]:
    out = {}
    for p in psutil.Process(launcher.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "streamnmt" in " ".join(p.cmdline()) and "RANK" in p.environ() and p.parent().pid != p.pid:
                if "torch.distributed.run" not in " ".join(p.cmdline()):
                    out.setdefault(int(p.environ()["RANK"]), p)
    return out


def kill_rank_after(launcher: Forked, steps: Path, rows: int, rank: int = 1,
                    timeout: float = 90) -> tuple[str, str, float]:
    """Once ``steps`` has more than ``rows`` rows, SIGKILL rank ``rank`` of ``launcher``'s run; its
    (stdout, stderr) and the seconds from the kill to the launcher's exit. Nothing it started outlives it."""
    try:
        wait_for_rows(steps, rows, launcher)
        rank_processes(launcher)[rank].kill()
        t0 = time.time()
        out, err = launcher.communicate(timeout=timeout)
        return out, err, time.time() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


def wait_for_rows(steps: Path, n: int, proc: Forked) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if steps.is_file() and len(steps.read_text().splitlines()) > n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{steps}: fewer than {n} rows in time")


def test_two_ranks_equal_one_rank_double_batch_full(two_ranks, one_rank_full):
    ref = one_rank_full
    assert_same_training(two_ranks, ref, steps=STEPS)
    rows, ref_rows = read_csv(two_ranks / "steps.csv"), read_csv(ref / "steps.csv")
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref_rows]  # global tokens per step
    # Rank 0 alone wrote: one run directory, no second one made by rank 1; --keep-last kept its two.
    assert sorted(p.name for p in two_ranks.parent.iterdir()) == ["ref"]
    assert sorted(p.name for p in (two_ranks / "weights").glob("step_*.pt")) == ["step_000020.pt", "step_000030.pt"]


def test_two_ranks_equal_one_rank_double_batch_graph(two_ranks_run, tmp_path, home):
    two, res = two_ranks_run  # asked for graph
    assert res.stderr.count("graph mode unavailable") + res.stdout.count("graph mode unavailable") == 1  # rank 0
    assert "strategy full (in place of graph); 2 processes (gloo)" in res.stdout  # the strategy that runs
    assert_same_training(two, one_rank(tmp_path, home, "graph"), steps=STEPS)


def test_two_ranks_with_accumulation_equal_one_rank(fresh_corpus_run, one_rank_full):
    """2 ranks x 2 micro-batches of 4 (DDP all-reduces on the second only) == 1 rank x 16 (on the
    same corpus, the built-in one in a directory of its own)."""
    assert_same_training(fresh_corpus_run[0], one_rank_full, steps=STEPS)


def test_kill_launcher_then_resume_is_exact(two_ranks, tmp_path, home, capsys):
    args = [*common(tmp_path), "--batch-size", "8", "--save-every", "10", "--name", "killed"]
    killed = torchrun(args, home, env={"STREAMNMT_TEST_KILL_AT_STEP": "25"})
    assert killed.returncode == -signal.SIGKILL
    run = tmp_path / "killed"
    last = run / "weights" / "last.pt"
    assert torch.load(last, weights_only=True)["step"] == 20
    # Another world size: it resumes, says in one line that it is not bit-exact, and finishes (one
    # process: the test's own).
    other = tmp_path / "other"
    shutil.copytree(run, other)
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("STREAMNMT_HOME", home)
        capsys.readouterr()
        assert main(["train", "--resume", str(other / "weights" / "last.pt")]) == 0
    out = capsys.readouterr()
    assert "not bit-exactly" in out.out + out.err
    assert [int(r["step"]) for r in read_csv(other / "steps.csv")] == list(range(1, STEPS + 1))
    # The same world size: exact.
    res = torchrun(["--resume", str(last)], home)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "not bit-exactly" not in res.stdout + res.stderr
    assert read_csv(run / "steps.csv") == read_csv(two_ranks / "steps.csv")
    a = torch.load(two_ranks / "weights" / "last.pt", weights_only=True)["model"]
    b = torch.load(last, weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_one_process_checkpoint_resumes_on_two_ranks(tmp_path, home):
    """A position saved by one process is converted to the two ranks' units: no batch of the epoch
    is skipped or repeated, and the run ends at its last step."""
    def killed() -> int:  # in a forked child of the test process, its imports paid
        os.environ.update(STREAMNMT_HOME=home, STREAMNMT_TEST_KILL_AT_STEP="15")
        sys.stdout = sys.stderr = open(tmp_path / "one.log", "w")  # noqa: SIM115 - the child's to its end
        with single_thread():
            return main(["train", *common(tmp_path), "--batch-size", "16", "--save-every", "10", "--name", "one"])

    assert in_child(killed) == -signal.SIGKILL, (tmp_path / "one.log").read_text()[-3000:]
    res = torchrun(["--resume", str(tmp_path / "one" / "weights" / "last.pt")], home)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "not bit-exactly" in res.stdout + res.stderr
    assert [int(r["step"]) for r in read_csv(tmp_path / "one" / "steps.csv")] == list(range(1, STEPS + 1))
    ckpt = torch.load(tmp_path / "one" / "weights" / "last.pt", weights_only=True)
    assert ckpt["step"] == STEPS and len(ckpt["rng_ranks"]) == 2
    # The saved position (10 of one process's batches) continues at the same share of the two ranks'
    # epoch (rounded up): the rest of epoch 1 is the two ranks' epoch less that, in their units.
    from streamnmt.data import DataConfig, make_loader, prepare_data
    os.environ["STREAMNMT_HOME"] = home
    try:
        cfg = DataConfig(builtin_size=500, max_len=32, batch_size=16)
        train = prepare_data(cfg, log=lambda _: None).train
    finally:
        del os.environ["STREAMNMT_HOME"]
    one, two = (len(make_loader(train, cfg, train=True, seed=3, pin_memory=False, world=w, rank=0)) for w in (1, 2))
    rows = read_csv(tmp_path / "one" / "steps.csv")
    assert sum(1 for r in rows if r["epoch"] == "1" and int(r["step"]) > 10) == two - -(-10 * two // one)
    said = [ln for ln in (res.stdout + res.stderr).splitlines() if "not bit-exactly" in ln]
    assert len(said) == 1 and f"epoch 1 continues at its step {-(-10 * two // one)} of {two}," in said[0], said
    assert "a step now trains 2 batches (of --batch-size or --max-tokens each), not 1" in said[0]


@pytest.mark.parametrize("target", ["rank 1", "launcher"])
def test_sigterm_stops_all_ranks_and_rank0_saves(tmp_path, home, target):
    args = [*TINY, "--epochs", "50", "--batch-size", "8", "--loss-interval", "1", "--sync-interval", "2",
            "--project", str(tmp_path), "--name", "t"]
    proc = streamnmt(["--nproc", "2", *args], home, wait=False)
    try:
        wait_for_rows(tmp_path / "t" / "steps.csv", 6, proc)
        ranks = rank_processes(proc)
        assert sorted(ranks) == [0, 1]
        (ranks[1] if target == "rank 1" else psutil.Process(proc.pid)).send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped by signal" in out + err
    ckpt = torch.load(tmp_path / "t" / "weights" / "last.pt", weights_only=True)
    assert ckpt["step"] == len(read_csv(tmp_path / "t" / "steps.csv")) >= 6
    assert ckpt["step"] % 2 == 0  # the ranks agree to stop every --sync-interval steps
    assert len(ckpt["rng_ranks"]) == 2


def test_dead_rank_ends_the_run_with_one_line(tmp_path, home):
    args = [*TINY, "--epochs", "50", "--batch-size", "8", "--loss-interval", "1", "--project", str(tmp_path),
            "--name", "d"]
    proc = streamnmt(["--nproc", "2", *args], home, wait=False)
    _, err, took = kill_rank_after(proc, tmp_path / "d" / "steps.csv", 4)
    assert proc.returncode not in (0, None) and took < 60
    assert "streamnmt: error: rank 1 failed (killed by SIGKILL)" in err
    assert not list((tmp_path / "d" / "weights").glob("*.tmp*"))  # no half-written checkpoint


@pytest.mark.parametrize("flags,names,ranks_start", [
    (["--device", "cpu", "--dist-backend", "nccl"], "--dist-backend", False),
    (["--nproc", "0"], "--nproc", False),
    (["--builtin-size", "100", "--batch-size", "64", "--no-pack"], "--nproc", True),  # rank 1 would get no pair at all
])
def test_bad_set_ups_exit_2_and_write_nothing(tmp_path, home, flags, names, ranks_start, capsys):
    """Flags the launcher refuses before it starts a rank are refused in the test process (its own
    imports paid); the ranks' refusal needs the ranks, so that one is a process of its own."""
    args = [*TINY, "--max-steps", "3", "--project", str(tmp_path / "runs"), "--name", "bad"]
    nproc = [] if "--nproc" in flags else ["--nproc", "2"]
    if ranks_start:
        res = streamnmt([*nproc, *args, *flags], home)
        code, err = res.returncode, res.stderr
    else:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STREAMNMT_HOME", home)
            capsys.readouterr()
            code = main(["train", *nproc, *args, *flags])
        err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("streamnmt: error:")]
    assert errors and names in errors[0]
    assert not (tmp_path / "runs").exists()


# -- ranks that agree, data prepared once, failures seen ------------------------------------------

def test_capture_failure_on_one_rank_stops_every_rank_with_one_line(tmp_path, home):
    """Graph capture failing on rank 1 alone (test hook; on the CPU, where graph mode is unavailable
    on every rank, the agreement runs all the same): both ranks stop, agreed, before anything is
    written, with one line naming the rank and the reason."""
    t0 = time.time()
    res = streamnmt(["--nproc", "2", *common(tmp_path / "runs", "graph"), "--batch-size", "8", "--name", "cap"],
                    home, env={"STREAMNMT_TEST_CAPTURE_FAIL_RANK": "1"})
    took = time.time() - t0
    assert res.returncode != 0 and took < 60, (took, res.stderr[-3000:])
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if "graph capture failed on rank" in ln]
    assert lines == ["streamnmt: error: graph capture failed on rank 1 of 2 (injected by "
                     "STREAMNMT_TEST_CAPTURE_FAIL_RANK); every rank stops (run with --sync-strategy full to "
                     "train without graphs)"]
    assert "Traceback" not in res.stdout + res.stderr
    assert not (tmp_path / "runs").exists()  # no run directory: the ranks stopped before it


def test_fresh_corpus_is_prepared_once(fresh_corpus_run, tmp_path):
    """Two ranks on a corpus directory without tokenizers or cache: rank 0 trains one tokenizer per
    side and writes one cache entry per split; rank 1 waits and reads them (it logs nothing, so
    rank 0's log shows the one training); the runs' tokenizers equal a one-process preparation's."""
    from streamnmt.data import DataConfig, prepare_data, synthetic
    from streamnmt.data.tokenizer import file_sha256

    _, fresh, res = fresh_corpus_run
    out = res.stdout + res.stderr
    assert out.count("data: trained source tokenizer and target tokenizer") == 1
    assert sorted(p.name for p in (fresh / "tokenizer").iterdir()) == ["src.model", "src.model.json", "tgt.model",
                                                                      "tgt.model.json"]  # each with its record
    entries = sorted(p.name.split("-")[0] for p in (fresh / "cache").iterdir())
    assert entries == ["dev", "test", "train"]  # one entry per split: every rank had the same key
    # Seeded SentencePiece: a one-process preparation of the same corpus trains the same models.
    corpus = tmp_path / "corpus"
    synthetic.write_builtin(corpus, 500, seed=0)
    bundle = prepare_data(DataConfig(data=str(corpus), max_len=32, src_vocab=32000, tgt_vocab=32000),
                          log=lambda _: None)  # the sizes AS_BUILTIN gives the runs
    assert bundle.src_tok.sha256 == file_sha256(fresh / "tokenizer" / "src.model")
    assert bundle.tgt_tok.sha256 == file_sha256(fresh / "tokenizer" / "tgt.model")


PREPARE_CASES = [(False, 1), (True, 1), (False, 2)]  # (the ranks' preparations differ, hosts)


def _prepare_once_rank(rank: int, ports: list[int], out: str) -> None:
    """One rank of a gloo group, for each case of PREPARE_CASES in turn (a group of its own each)."""
    for (differ, hosts), port in zip(PREPARE_CASES, ports):
        case = Path(out) / f"{differ}-{hosts}"
        case.mkdir(exist_ok=True)
        _prepare_once_case(rank, port, case, differ, hosts)


def _prepare_once_case(rank: int, port: int, out: Path, differ: bool, hosts: int) -> None:
    """``prepare_once`` with a preparation that records when it ran (``hosts`` 2: each rank the
    local rank 0 of a host of its own)."""
    local = "0" if hosts == 2 else str(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=local, LOCAL_WORLD_SIZE=str(2 // hosts), GROUP_RANK=str(rank if hosts == 2 else 0))
    from streamnmt import dist
    from streamnmt.data.prepare import prepare_once
    from streamnmt.errors import InputError
    d = dist.init("gloo", "cpu", 30)
    log = out / f"rank{rank}"

    def prepare() -> str:
        log.write_text(f"start {time.time()}\n")
        time.sleep(0.5 if rank == 0 else 0.0)
        with log.open("a") as f:
            f.write(f"end {time.time()}\n")
        return f"tok-{rank}" if differ else "tok"

    try:
        prepare_once(d, prepare, lambda tok: {"src tokenizer sha256": tok})
        result = "ok"
    except InputError as e:
        result = f"error: {e}"
    (out / f"result{rank}").write_text(result)
    d.close()


@pytest.fixture(scope="module")
def prepare_once_cases(tmp_path_factory) -> Path:
    """Every case of PREPARE_CASES, run by one pair of processes forked from the test process (a
    fresh process's imports cost seconds)."""
    out = tmp_path_factory.mktemp("prepare-once")
    torch.multiprocessing.start_processes(_prepare_once_rank, args=([free_port() for _ in PREPARE_CASES], str(out)),
                                          nprocs=2, join=True, start_method="fork")
    return out


@pytest.mark.parametrize("differ,hosts", PREPARE_CASES)
def test_prepare_once_waits_for_rank0_then_checks_fingerprints(prepare_once_cases, differ, hosts):
    """Rank 0 prepares first; on two hosts too, where each rank is its host's local rank 0 (a shared
    data directory: the other host's preparation must find rank 0's files, not write beside it)."""
    out = prepare_once_cases / f"{differ}-{hosts}"
    times = {r: dict(line.split() for line in (out / f"rank{r}").read_text().splitlines()) for r in (0, 1)}
    assert float(times[1]["start"]) >= float(times[0]["end"])  # rank 1 prepared only after rank 0 had
    results = [(out / f"result{r}").read_text() for r in (0, 1)]
    if not differ:
        assert results == ["ok", "ok"]
    else:  # every rank stops with the same line naming the rank that differs
        assert results[0] == results[1] and results[0].startswith("error: rank 1 of 2 prepared other data than "
                                                                  "rank 0: src tokenizer sha256 tok-1")


def test_killed_rank_ends_the_others_with_one_line(tmp_path, home):
    """kill -9 of rank 1, with no launcher to clean up (ranks of another host): rank 0 sees its
    collective fail and exits non-zero with one line, well within --dist-timeout."""
    port = free_port()
    args = [*TINY, "--epochs", "50", "--batch-size", "8", "--loss-interval", "1", "--dist-timeout", "40",
            "--project", str(tmp_path), "--name", "k"]
    procs = [streamnmt(args, home, env=dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                                            WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2"), wait=False)
             for r in (0, 1)]
    try:
        wait_for_rows(tmp_path / "k" / "steps.csv", 4, procs[0])
        procs[1].kill()
        t0 = time.time()
        out, err = procs[0].communicate(timeout=90)
        took = time.time() - t0
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    assert procs[0].returncode == 3 and took < 40, (took, err[-3000:])  # 3: a bystander of a lost peer
    errors = [ln for ln in err.splitlines() if ln.startswith("streamnmt: error:")]
    assert len(errors) == 1 and errors[0].startswith("streamnmt: error: rank 0 of 2: a collective failed"), err[-3000:]
    assert "Traceback" not in err


def two_hosts(args: list[str], home: str) -> list[Forked]:
    """Two launchers as two hosts start them (``torchrun --nnodes 2 --nproc-per-node 1
    --rdzv-backend c10d``) on one machine: the first hosts the rendezvous store, the second joins."""
    port = free_port()
    run = torchrun_main(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                         f"127.0.0.1:{port}", "--rdzv-id", "two-hosts", "-m", "streamnmt", "train", *args])
    first = launch(run, home, None, wait=False)
    deadline = time.time() + 60
    while time.time() < deadline and first.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        time.sleep(0.1)
    return [first, launch(run, home, None, wait=False)]


def finish(procs: list[Forked], timeout: float = 180) -> list[tuple[int, str]]:
    """Each launcher's exit code and its stdout and stderr; nothing they started outlives them."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, out + err) for p, (out, err) in zip(procs, outs)]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


def test_two_hosts_prepare_once_and_train_as_one_host_with_two_processes(two_ranks, tmp_path, home):
    """Two launchers on one shared corpus directory (no tokenizer, no cache yet) and one run
    directory: one preparation (rank 0's), one run directory, and the training of one host's two
    processes (the module's reference run, on the same corpus as the built-in one)."""
    from streamnmt.data import synthetic

    corpus = tmp_path / "corpus"
    synthetic.write_builtin(corpus, 500, seed=0)  # the built-in corpus the reference trained on
    runs = tmp_path / "runs"
    args = [*common(runs), "--batch-size", "8", "--save-every", "10", "--keep-last", "2", "--data", str(corpus),
            "--name", "hosts", *AS_BUILTIN]
    results = finish(two_hosts(args, home))
    assert [code for code, _ in results] == [0, 0], "\n".join(text[-3000:] for _, text in results)
    text = "".join(t for _, t in results)
    assert text.count("data: trained source tokenizer and target tokenizer") == 1
    assert sorted(p.name for p in (corpus / "tokenizer").iterdir()) == ["src.model", "src.model.json", "tgt.model",
                                                                       "tgt.model.json"]
    assert sorted(p.name.split("-")[0] for p in (corpus / "cache").iterdir()) == ["dev", "test", "train"]
    assert sorted(p.name for p in runs.iterdir()) == ["hosts"]
    assert [(r["step"], r["loss"]) for r in read_csv(runs / "hosts" / "steps.csv")] == \
           [(r["step"], r["loss"]) for r in read_csv(two_ranks / "steps.csv")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the rank's environment from /proc")
def test_a_killed_host_ends_the_other_within_the_timeout_with_one_line(tmp_path, home):
    """kill -9 of one host's launcher (its rank dies with it): the other host's rank sees its
    collective fail and ends well within --dist-timeout, with one line naming the lost host."""
    args = [*TINY, "--epochs", "50", "--batch-size", "8", "--loss-interval", "1", "--dist-timeout", "30",
            "--project", str(tmp_path), "--name", "k"]
    procs = two_hosts(args, home)
    try:
        wait_for_rows(tmp_path / "k" / "steps.csv", 4, procs[0])
        rank = next(c for c in psutil.Process(procs[1].pid).children(recursive=True) if "streamnmt" in c.cmdline())
        node = rank.environ()["GROUP_RANK"]
        procs[1].kill()
        t0 = time.time()
        (code, text), _ = finish(procs, timeout=60)
        took = time.time() - t0
    finally:
        finish(procs, timeout=1) if any(p.poll() is None for p in procs) else None
    errors = [ln for ln in text.splitlines() if ln.startswith("streamnmt: error:")]
    assert code != 0 and took < 30, (took, text[-3000:])
    assert len(errors) == 1 and "a collective failed" in errors[0], text[-3000:]
    assert f"lost host: node {node} (" in errors[0], errors[0]


def test_launcher_blames_the_rank_that_failed_for_its_own_reason():
    """Rank 0 notices a killed rank 1 and exits (PeerLost, code 3) before torchrun sees the kill,
    in the same second: the line names rank 1. A rank that failed on its own (a bad flag, a crash)
    is named over bystanders; with bystanders alone, the earliest."""
    from types import SimpleNamespace as F

    from streamnmt.dist import PeerLost, first_failure

    lost = PeerLost.exit_code
    assert first_failure({0: F(exitcode=lost, timestamp=100), 1: F(exitcode=-9, timestamp=100)})[0] == 1
    assert first_failure({0: F(exitcode=lost, timestamp=99), 1: F(exitcode=1, timestamp=101)})[0] == 1
    assert first_failure({0: F(exitcode=2, timestamp=100), 1: F(exitcode=1, timestamp=101)})[0] == 0
    assert first_failure({0: F(exitcode=lost, timestamp=101), 1: F(exitcode=lost, timestamp=100)})[0] == 1
    assert first_failure({1: F(exitcode=lost, timestamp=100), 0: F(exitcode=lost, timestamp=100)})[0] == 0
    # torchrun stops the survivors of a failed rank with SIGTERM, within the same second
    assert first_failure({0: F(exitcode=-15, timestamp=100), 1: F(exitcode=2, timestamp=100)})[0] == 1
    assert first_failure({0: F(exitcode=-15, timestamp=100), 1: F(exitcode=-9, timestamp=100)})[0] == 1
    assert first_failure({0: F(exitcode=-15, timestamp=100), 1: F(exitcode=lost, timestamp=99)})[0] == 0


def test_polled_wait_ends_in_peer_lost():
    """A host wait on work that never completes (a replayed all-reduce whose peer died) raises
    PeerLost with one line after the timeout; completed work returns at once."""
    from streamnmt.dist import PeerLost, wait_event

    class Event:
        def __init__(self, done: bool):
            self.done, self.queries = done, 0

        def query(self) -> bool:
            self.queries += 1
            return self.done

    wait_event(Event(True), 0.1)
    t0 = time.time()
    stuck = Event(False)
    with pytest.raises(PeerLost) as e:
        wait_event(stuck, 0.3)
    assert 0.3 <= time.time() - t0 < 5 and stuck.queries > 10
    assert "\n" not in str(e.value) and "--dist-timeout 0.3 s" in str(e.value)


def test_lockstep_exchanges_wait_dist_timeout_and_long_waits_the_control_group(monkeypatch):
    """A stop agreement or an RNG gather, which the ranks reach together, runs on the group whose
    timeout is --dist-timeout (a hung peer is lost then, not after CONTROL_TIMEOUT_S); an exchange
    where one rank first works alone (data preparation) waits on the long control group."""
    import torch.distributed as tdist

    from streamnmt.dist import Dist, is_collective_error

    used: list[tuple[str, object]] = []
    monkeypatch.setattr(tdist, "all_reduce", lambda t, op=None, group=None: used.append(("agree", group)))
    monkeypatch.setattr(tdist, "all_gather_object", lambda out, obj, group=None: used.append(("gather", group)))
    d = Dist(rank=0, world=2, backend="gloo", control="CONTROL", lockstep="LOCKSTEP")
    d.agree(False)
    d.gather(1)
    d.agree(False, long_wait=True)
    d.gather(1, long_wait=True)
    assert used == [("agree", "LOCKSTEP"), ("gather", "LOCKSTEP"), ("agree", "CONTROL"), ("gather", "CONTROL")]
    # the lines gloo gives after a timeout are a lost peer's, not a bug's
    for text in ("Application timeout caused pair closure",
                 "Operation timed out!", "Timed out waiting 10000ms for recv operation to complete"):
        assert is_collective_error(RuntimeError(text)), text
    assert not is_collective_error(RuntimeError("shape mismatch"))


def test_agree_any_takes_each_flag_from_any_rank_in_one_all_reduce(monkeypatch):
    """Several flags in one host all-reduce (MAX): each True wherever any rank's is; the other
    rank here says (stop, not due), this one (no stop, due)."""
    import torch.distributed as tdist

    from streamnmt.dist import Dist

    calls: list[list[int]] = []

    def all_reduce(t, op=None, group=None):
        calls.append(t.tolist())
        t.copy_(torch.maximum(t, torch.tensor([1, 0], dtype=t.dtype)))  # the other rank's flags

    monkeypatch.setattr(tdist, "all_reduce", all_reduce)
    d = Dist(rank=0, world=2, backend="gloo", control="CONTROL", lockstep="LOCKSTEP")
    assert d.agree_any((False, True), "dist.step") == (True, True)
    assert calls == [[0, 1]]  # one collective for both
    assert Dist().agree_any((False, True)) == (False, True)  # one process: its own
