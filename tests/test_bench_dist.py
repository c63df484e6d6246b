"""The benchmark on several processes (CPU, gloo): ``--nproc 1,2`` writes each world size and the
scaling summary with consistent numbers, plain torchrun works the same (rank 0 alone writes,
``--profile`` included), the merge of the ranks' numbers, NCCL kernels in a trace, bad set-ups.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from streamnmt import cli
from streamnmt.bench.profile import ALL_REDUCE, analyze_trace, format_summary
from streamnmt.bench.scaling import merge_ranks
from tests.test_dist import free_port, torchrun_main
from tests.test_dist import launch as launch_process

TINY = ["--device", "cpu", "--model", "tiny", "--builtin-size", "400", "--batch-size", "8", "--max-len", "16",
        "--warmup", "1", "--steps", "3", "--repeats", "1", "--workers", "0", "--no-references"]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("home"))


def launch(what: list[str] | Callable[[], int], home: str) -> subprocess.CompletedProcess:
    """Run a command, or a function in a forked child of the test process (``streamnmt bench``'s
    parent, torchrun's entry point: their ranks are fresh processes), to the end in its own session
    (the trainer tests' launcher, 1 OpenMP thread)."""
    return launch_process(what, home, None, True)


def bench(argv: list[str]) -> Callable[[], int]:
    """What ``python -m streamnmt bench ARGV`` runs."""
    return lambda: cli.main(["bench", *argv])


@pytest.fixture(scope="module")
def scaling(tmp_path_factory, home) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("scaling") / "exp"
    res = launch(bench([*TINY, "--strategies", "full", "--nproc", "1,2", "--out", str(out)]), home)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


def test_scaling_writes_each_world_size_and_the_summary(scaling):
    out, res = scaling
    for path in ("bench.json", "bench.csv", "bench.png", "nproc1/bench.json", "nproc2/bench.json",
                 "nproc2/bench.csv", "nproc2/bench.png"):
        assert (out / path).is_file(), path
    record = json.loads((out / "bench.json").read_text())
    assert record["world_sizes"] == [1, 2] and record["runs"] == {"1": "nproc1/bench.json", "2": "nproc2/bench.json"}
    rows = {(r["name"], r["world"]): r for r in record["summary"]}
    assert set(rows) == {("full", 1), ("full", 2)}
    one, two = rows["full", 1], rows["full", 2]
    # global = per-GPU x N; efficiency = per-GPU at 2 / per-GPU at 1
    for r in (one, two):
        assert r["tokens_per_s_per_gpu"] * r["world"] == pytest.approx(r["tokens_per_s"])
    assert two["scaling_eff_pct"] == pytest.approx(100 * two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"])
    assert one["scaling_eff_pct"] == pytest.approx(100) and two["scaling_base"] == 1
    # each world size's own record agrees with the summary
    for n, r in ((1, one), (2, two)):
        sub = json.loads((out / f"nproc{n}" / "bench.json").read_text())
        assert sub["world"] == n and sub["dist_backend"] == "gloo"  # torchrun: a process group (DDP) even at 1
        assert sub["summary"][0]["tokens_per_s"] == pytest.approx(r["tokens_per_s"])
        assert sub["summary"][0]["ms_per_step"] == pytest.approx(r["ms_per_step"])
    with open(out / "bench.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert [(c["name"], int(c["world"])) for c in csv_rows] == [("full", 1), ("full", 2)]
    assert float(csv_rows[1]["scaling_eff_pct"]) == pytest.approx(two["scaling_eff_pct"])
    assert float(csv_rows[1]["tokens_per_s_per_gpu"]) == pytest.approx(two["tokens_per_s_per_gpu"])


def test_two_ranks_numbers_merge_every_rank(scaling):
    out, _ = scaling
    sub = json.loads((out / "nproc2" / "bench.json").read_text())
    (run,) = sub["runners"]["full"]["runs"]
    ranks = run["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and run["world"] == 2
    assert all(r["tokens"] > 0 for r in ranks)  # each rank trained on its own shard
    assert run["tokens"] == sum(r["tokens"] for r in ranks)
    assert run["wall_s"] == max(r["wall_s"] for r in ranks)  # the slowest rank's time
    assert run["ms_per_step"] == pytest.approx(1e3 * run["wall_s"] / 3)
    assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["wall_s"])
    summary = sub["summary"][0]
    assert summary["world"] == 2 and summary["tokens_per_s_per_gpu"] == pytest.approx(run["tokens_per_s"] / 2)


def test_scaling_console_rank_zero_only_table_last(scaling):
    _, res = scaling
    text = res.stdout
    # rank 0 alone prints: one progress line per world size, not one per rank
    assert text.count("bench: full            run 1/1") == 2
    assert text.count("bench: wrote bench.json") == 3  # nproc1, nproc2, the summary
    tail = text[text.rindex("bench: wrote bench.json"):]
    header = tail.splitlines()[1]
    assert header.split()[:3] == ["row", "GPUs", "ms/step"] and "tok/s per GPU" in header and "scaling" in header
    lines = tail.splitlines()
    assert lines[3].split()[:2] == ["full", "1"] and lines[4].split()[:2] == ["full", "2"]
    assert "Traceback" not in res.stderr


def test_plain_torchrun_profile_rank_zero_writes(tmp_path, home, scaling):
    out = tmp_path / "exp"
    res = launch(torchrun_main(["--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "streamnmt",
                                "bench", *TINY, "--strategies", "baseline,full", "--profile", "--profile-steps",
                                "2", "--out", str(out)]), home)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.json", "bench.png", "trace_baseline.json",
                                                     "trace_full.json"]
    record = json.loads((out / "bench.json").read_text())
    assert record["world"] == 2 and record["rows"] == ["baseline", "full"]
    assert all(len(record["runners"][n]["runs"][0]["ranks"]) == 2 for n in record["rows"])
    assert res.stdout.count("bench: profiled full") == 1 and res.stdout.count("bench: baseline        run") == 1
    table = res.stdout[res.stdout.rindex("bench: wrote"):].splitlines()[1]
    assert "tok/s per GPU" in table


def test_merge_ranks():
    def result(wall: float, tokens: int, mem: float) -> dict:
        return {"steps": 4, "wall_s": wall, "ms_per_step": 1e3 * wall / 4, "tokens": tokens,
                "tokens_per_s": tokens / wall, "padded_tokens_per_s": 2 * tokens / wall, "model_tflops": 1.0,
                "mfu_pct": None, "gpu_busy_pct": 50.0 + wall, "peak_mem_mb": mem, "sync_count": 1}
    merged = merge_ranks([result(2.0, 100, 10.0), result(4.0, 300, 30.0)], peak_flops=1e12)
    assert merged["wall_s"] == 4.0 and merged["slowest_rank"] == 1 and merged["ms_per_step"] == 1000.0
    assert merged["tokens"] == 400 and merged["tokens_per_s"] == 100.0
    assert merged["padded_tokens_per_s"] == pytest.approx((2 * 100 + 2 * 300) / 4.0)
    assert merged["model_tflops"] == pytest.approx((2.0 + 4.0) / 4.0)      # TFLOP of both ranks / slowest time
    assert merged["mfu_pct"] == pytest.approx(100 * 1.5 / 2)               # / (2 GPUs x 1 TFLOP/s)
    assert merged["gpu_busy_pct"] == 52.0 and merged["peak_mem_mb"] == 30.0  # rank 0's span, the largest memory
    assert [r["tokens"] for r in merged["ranks"]] == [100, 300]


def test_trace_names_the_nccl_stream():
    def kernel(name: str, stream: int, ts: float, corr: int) -> list[dict]:
        return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts - 5, "dur": 2,
                 "args": {"correlation": corr}},
                {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": 10,
                 "args": {"stream": stream, "correlation": corr}}]
    events = [{"ph": "X", "cat": "user_annotation", "name": "step.backward", "ts": 0, "dur": 100}]
    events += kernel("void at::native::elementwise_kernel", 7, 20, 1)
    events += kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 23, 40, 2)
    summary = analyze_trace({"traceEvents": events})
    assert summary.streams[ALL_REDUCE] == {23: [1, pytest.approx(0.01)]}
    assert summary.streams["backward"] == {7: [1, pytest.approx(0.01)]}


def test_trace_says_how_much_of_the_all_reduce_hides_behind_other_kernels():
    """An all-reduce of 10 us beside 4 us of backward kernels (one of them on the main stream before
    it, one overlapping): 4 us hidden, 6 us exposed; a second all-reduce alone is all exposed."""
    def kernel(name: str, stream: int, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}
    nccl = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
    events = [kernel("gemm_a", 7, 0, 12), kernel(nccl, 23, 10, 10), kernel("gemm_b", 7, 18, 2),
              kernel(nccl, 23, 40, 5)]
    s = analyze_trace({"traceEvents": events})
    assert s.all_reduce_ms == pytest.approx(0.015) and s.all_reduce_hidden_ms == pytest.approx(0.004)
    assert s.to_dict()["all_reduce_hidden_pct"] == pytest.approx(100 * 4 / 15)
    assert "all-reduce: 0.01 ms in the window, 27% of it beside other kernels" in format_summary("graph", s)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("flags, names", [(["--nproc", "0"], "--nproc"), (["--nproc", "1,x"], "--nproc"),
                                          (["--nproc", "2,2"], "--nproc"),
                                          (["--nproc", "2", "--dist-backend", "nccl"], "--dist-backend")])
def test_bad_set_ups_exit_2_writing_nothing(flags, names, tmp_path, capsys):
    code, err = run_cli(["bench", *TINY, *flags, "--out", str(tmp_path / "b")], capsys)
    assert code == 2 and names in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


def test_more_ranks_than_gpus_exits_2_writing_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = [a for a in TINY if a not in ("--device", "cpu")]
    code, err = run_cli(["bench", *args, "--device", "cuda", "--nproc", "2", "--out", str(tmp_path / "b")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--nproc" in err and "2 processes but only 1 CUDA device" in err
    assert not (tmp_path / "b").exists()


def test_nproc_under_torchrun_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, err = run_cli(["bench", *TINY, "--nproc", "2", "--out", str(tmp_path / "b")], capsys)
    assert code == 2 and "--nproc" in err and "already runs under torchrun" in err
    assert not (tmp_path / "b").exists()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_nccl_graph_rows_and_the_all_reduce_in_the_trace(tmp_path, home):
    out = tmp_path / "exp"
    drop = {"--device", "--warmup"}  # flag and value dropped in pairs ("1" is also --repeats' value)
    args = [a for i, a in enumerate(TINY) if a not in drop and (i == 0 or TINY[i - 1] not in drop)]
    # a fresh process: the test process has made CUDA's context, which a forked child cannot use
    res = launch([sys.executable, "-m", "streamnmt", "bench", *args, "--warmup", "12", "--pad-multiple", "16",
                  "--strategies", "full,graph", "--nproc", "1,2", "--profile", "--profile-steps", "3",
                  "--out", str(out)], home)
    assert res.returncode == 0, res.stderr[-3000:]
    two = json.loads((out / "nproc2" / "bench.json").read_text())
    assert two["world"] == 2 and two["dist_backend"] == "nccl" and two["rows"] == ["full", "graph"]
    assert "fallback" not in two["runners"]["graph"]["report"]  # graph capture with DDP's all-reduce inside
    for name in ("full", "graph"):  # rank 0's trace shows NCCL's kernels on a stream of their own
        streams = two["profile"][name]["kernels_per_stream"]
        assert "nccl all-reduce" in streams, sorted(streams)
    assert sorted(p.name for p in (out / "nproc2").glob("trace_*.json")) == ["trace_full.json", "trace_graph.json"]
    rows = {(r["name"], r["world"]): r for r in json.loads((out / "bench.json").read_text())["summary"]}
    assert set(rows) == {(n, w) for n in ("full", "graph") for w in (1, 2)}
    assert all(r["scaling_eff_pct"] > 0 for r in rows.values())


def test_config_argv_round_trips():
    from streamnmt.bench import BenchConfig
    from streamnmt.bench.scaling import config_argv
    from streamnmt.configbase import from_dict

    cfg = BenchConfig(strategies="full,graph", references=False, compile=True, nproc="1,2", max_len=24, out="o")
    args = vars(cli.build_parser().parse_args(["bench", *config_argv(cfg)]))
    args.pop("_run"), args.pop("command")
    assert from_dict(BenchConfig, args) == cfg


@pytest.mark.parametrize("cfg, said", [({"batch_size": 32, "max_tokens": 0}, "--batch-size 32"),
                                       ({"batch_size": 32, "max_tokens": 4096, "pack": True}, "--max-tokens 4096 packed"),
                                       ({"batch_size": 32, "max_tokens": 4096, "pack": False}, "--max-tokens 4096")])
def test_scaling_footnote_names_the_batch_each_rank_ran(cfg, said):
    from streamnmt.bench.scaling import per_rank_batch
    assert per_rank_batch(cfg) == said
