"""The benchmark on CPU: files and numbers it writes, the FLOP counter, the noise rule, the trace reader."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
from pathlib import Path

import pytest
import torch

from streamnmt import cli
from streamnmt.bench import BenchConfig, forward_flops, peak_flops, spread, training_flops, within_noise
from streamnmt.bench.profile import analyze_trace, format_summary
from streamnmt.bench.stats import NOISE, format_table, summarize
from streamnmt.config import RunConfig
from streamnmt.errors import ConfigError
from streamnmt.models.transformer import ModelShape
from tests.conftest import single_thread

SMALL = ["--device", "cpu", "--model", "tiny", "--builtin-size", "2000", "--batch-size", "16", "--max-len", "16",
         "--warmup", "2", "--repeats", "2"]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path_factory):
    # The built-in corpus is written once per session, under the test's temporary directory.
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path_factory.getbasetemp() / "home"))
    with single_thread():
        yield


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("bench") / "exp"
    mp = pytest.MonkeyPatch()
    mp.setenv("STREAMNMT_HOME", str(tmp_path_factory.getbasetemp() / "home"))
    buf = io.StringIO()
    try:
        with single_thread(), contextlib.redirect_stdout(buf):
            code = cli.main(["bench", *SMALL, "--steps", "8", "--strategies", "baseline,interval,full",
                             "--out", str(out)])
    finally:
        mp.undo()
    assert code == 0
    return out, json.loads((out / "bench.json").read_text()), buf.getvalue()


def test_bench_writes_json_csv_png(bench_run):
    out, record, _ = bench_run
    assert (out / "bench.png").stat().st_size > 1000
    assert record["rows"] == ["plain", "baseline", "interval", "full", "resident"]  # references added
    assert all(n.startswith(("resident-graph left out", "compile-ro left out")) for n in record["left_out"])
    for key in ("config", "device", "torch", "date", "git", "model", "data"):
        assert key in record
    assert record["config"]["model"] == "tiny" and record["config"]["amp"] == "off"
    for name in record["rows"]:
        runs = record["runners"][name]["runs"]
        assert len(runs) == 2
        for r in runs:
            assert r["steps"] == 8 and r["wall_s"] > 0 and r["ms_per_step"] > 0 and r["tokens_per_s"] > 0
            # padded positions include the PAD tail of every row: more than the real tokens
            assert r["padded_tokens_per_s"] > r["tokens_per_s"]
            assert r["gpu_busy_pct"] is None and r["mfu_pct"] is None and r["peak_mem_mb"] is None
    with open(out / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == record["rows"]
    assert all(float(r["ms_per_step"]) > 0 for r in rows)


def test_bench_sync_counts_match_the_strategies(bench_run):
    _, record, _ = bench_run
    runs = {name: r["runs"] for name, r in record["runners"].items()}
    # plain reads loss.item() every step, through host_sync: one counted wait per step.
    for r in runs["plain"]:
        assert r["sync_count"] == 8 and r["syncs"]["bench.plain.loss"]["count"] == 8
    # On CPU the stream manager has nothing to wait for: the strategies' waits are free, uncounted.
    for name in ("baseline", "interval", "full", "resident"):
        for r in runs[name]:
            assert r["sync_count"] == 0 and r["syncs"] == {}
    assert record["runners"]["full"]["workers"] >= 1 and record["runners"]["baseline"]["workers"] == 0


def test_bench_table_is_printed_last(bench_run):
    _, record, stdout = bench_run
    tail = stdout[stdout.index("row "):]
    for name in record["rows"]:
        assert f"\n{name} " in tail
    assert "ms/step [min-max]" in tail and "vs baseline" in tail and "% of limit" in tail


def test_profile_on_cpu_writes_a_trace(tmp_path, capsys):
    out = tmp_path / "prof"
    code = cli.main(["bench", *SMALL, "--repeats", "1", "--steps", "3", "--strategies", "baseline",
                     "--no-references", "--profile", "--profile-steps", "2", "--out", str(out)])
    assert code == 0
    trace = json.loads((out / "trace_baseline.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "bench.window" in names and "step.forward" in names  # CPU ops and our ranges
    assert "need CUDA" in capsys.readouterr().out
    assert not (out / "timeline.png").exists()
    profile = json.loads((out / "bench.json").read_text())["profile"]["baseline"]
    assert profile["gpu"] is None and profile["critical_path"] is None  # no GPU op: no step view


def test_tied_embeddings_as_the_trainer_ties_them(tmp_path, capsys):
    """--tie-embeddings decoder runs and says so; all with two vocabularies is refused, naming the flag."""
    counts = {}
    for tie in ("none", "decoder"):
        code = cli.main(["bench", *SMALL, "--repeats", "1", "--steps", "3", "--strategies", "baseline",
                         "--no-references", "--tie-embeddings", tie, "--out", str(tmp_path / tie)])
        out = capsys.readouterr().out
        assert code == 0 and ("; tied embeddings: decoder" in out) == (tie == "decoder")
        counts[tie] = float(re.search(r"d_model 64, ([0-9.]+)M parameters", out).group(1))
    assert counts["decoder"] < counts["none"]  # the output projection is the target embedding
    code = cli.main(["bench", *SMALL, "--repeats", "1", "--steps", "3", "--strategies", "baseline",
                     "--no-references", "--tie-embeddings", "all", "--out", str(tmp_path / "all")])
    err = capsys.readouterr().err
    assert code == 2 and "--tie-embeddings" in err and "one vocabulary" in err
    assert not (tmp_path / "all").exists()


def test_bad_flags_name_the_flag(tmp_path, capsys):
    assert cli.main(["bench", "--device", "cpu", "--strategies", "baseline,fast", "--out", str(tmp_path)]) == 2
    assert "--strategies" in capsys.readouterr().err
    assert cli.main(["bench", "--device", "cpu", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--repeats"):
        BenchConfig(repeats=0)


def test_rows_and_auto_settings(monkeypatch):
    cfg = BenchConfig(strategies="graph,baseline")
    rows, notes = cfg.rows(torch.device("cpu"))
    assert rows == ["plain", "baseline", "graph", "resident"]
    assert any("resident-graph" in n for n in notes) and any("compile-ro" in n for n in notes)
    from streamnmt.bench import config as bench_config
    monkeypatch.setattr(bench_config, "peer_available", lambda device, name="compile-ro": None)  # as on a CUDA machine with Triton
    rows, _ = cfg.rows(torch.device("cuda"))
    assert rows == ["plain", "compile-ro", "baseline", "graph", "resident", "resident-graph"]
    monkeypatch.setattr(bench_config, "peer_available", lambda device, name="compile-ro": f"{name} left out: no triton")
    rows, notes = cfg.rows(torch.device("cuda"))
    assert "compile-ro" not in rows and notes == ["compile-ro left out: no triton"]
    assert BenchConfig(strategies="all", references=False).rows(torch.device("cpu"))[0][-1] == "resident"
    r = BenchConfig().resolve(torch.device("cpu"))
    assert (r.model, r.amp, r.device) == ("tiny", "off", "cpu") and r.workers >= 1
    assert (r.ema, r.ema_every) == (RunConfig().ema, RunConfig().ema_every) == (0.9999, 4)  # the trainer's


def test_flops_match_a_hand_count():
    # d=4, 1 layer, d_ff=8, target vocabulary 10; B=1, S=2, T=3.
    s = ModelShape(src_vocab=7, tgt_vocab=10, d_model=4, n_layers=1, n_heads=2, d_ff=8)
    enc = 2 * (4 * 2 * 4 * 4 + 2 * 2 * 4 * 8 + 2 * 2 * 2 * 4)         # 2 tokens: 128 + 128 + 32 each
    self_attn = 3 * (4 * 2 * 4 * 4 + 2 * 2 * 3 * 4)                    # 3 tokens: 128 + 48 each
    cross = 3 * (2 * 2 * 4 * 4 + 2 * 2 * 2 * 4) + 2 * (2 * 2 * 4 * 4)  # q/out + scores over S; k/v of memory
    ffn = 3 * (2 * 2 * 4 * 8)
    gen = 3 * 2 * 4 * 10
    assert enc == 576 and self_attn == 528 and cross == 288 + 128 and ffn == 384 and gen == 240
    assert forward_flops(s, 1, 2, 3) == 576 + 528 + 416 + 384 + 240
    assert training_flops(s, 1, 2, 3) == 3 * forward_flops(s, 1, 2, 3)
    assert forward_flops(s, 5, 2, 3) == 5 * forward_flops(s, 1, 2, 3)  # linear in the batch


def test_peak_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.5e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312e12)
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_flops("x86_64", "off") is None


def test_within_noise_rule():
    assert spread([3.0, 1.0, 2.0]).median == 2.0 and spread([3.0, 1.0, 2.0]).range == 2.0
    assert within_noise([10.0, 11.0, 12.0], [10.5, 11.5, 12.5])   # 0.5 apart, ranges 2
    assert not within_noise([10.0, 10.1, 10.2], [12.0, 12.1, 12.2])  # 2 apart, ranges 0.2
    assert within_noise([10.0, 10.1, 14.0], [12.0, 12.1, 12.2])   # the larger range (4) counts
    assert not within_noise([10.0], [10.5])  # one run: no spread, every difference counts
    assert not within_noise([10.0, 11.0], [11.0, 12.0])  # a difference equal to the range is not noise


def test_summary_labels_noise_and_limits():
    def runs(ms: list[float]) -> list[dict]:
        return [{"ms_per_step": m, "tokens_per_s": 1000 / m} for m in ms]

    rows = summarize({"baseline": runs([40, 41, 42]), "interval": runs([40.5, 41.5, 43]),
                      "graph": runs([10, 10.2, 10.4]), "resident": runs([30, 30.5, 31]),
                      "resident-graph": runs([8, 8.1, 8.2])})
    by = {r["name"]: r for r in rows}
    assert by["interval"]["speedup_noise"] and not by["graph"]["speedup_noise"]
    assert by["graph"]["speedup"] == pytest.approx(41 / 10.2)
    assert by["graph"]["pct_of_limit_ref"] == "resident-graph" and by["interval"]["pct_of_limit_ref"] == "resident"
    assert by["graph"]["pct_of_limit"] == pytest.approx(100 * 8.1 / 10.2)
    table = format_table(rows)
    line = {ln.split()[0]: ln for ln in table.splitlines()[2:]}
    assert NOISE in line["interval"] and "4.02x" in line["graph"] and "79%" in line["graph"]


def _trace(events: list[tuple]) -> dict:
    """A minimal Kineto-style trace from (cat, name, ts, dur, args) tuples."""
    return {"traceEvents": [{"ph": "X", "cat": c, "name": n, "ts": ts, "dur": d, "args": a, "pid": 0, "tid": 0}
                            for c, n, ts, d, a in events]}


def test_trace_analysis_attributes_kernels_and_idle_time():
    trace = _trace([
        ("user_annotation", "bench.window", 0, 100, {}),
        ("user_annotation", "step.forward", 0, 20, {}),
        ("user_annotation", "step.backward", 20, 30, {}),
        ("cuda_runtime", "cudaMemcpyAsync", 1, 1, {"correlation": 1}),
        ("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 5, 5, {"stream": 7, "correlation": 1}),  # idle 0-5: data
        ("cuda_runtime", "cudaLaunchKernel", 9, 1, {"correlation": 2}),
        ("kernel", "fwd", 10, 10, {"stream": 13, "correlation": 2}),           # forward, stream 13
        ("cuda_runtime", "cudaLaunchKernel", 25, 1, {"correlation": 3}),
        ("kernel", "bwd", 30, 10, {"stream": 13, "correlation": 3}),           # idle 20-30: launch
        ("cuda_runtime", "cudaStreamSynchronize", 38, 23, {}),                 # idle 40-70: sync
        ("cuda_runtime", "cudaLaunchKernel", 65, 1, {"correlation": 4}),
        ("kernel", "opt", 70, 10, {"stream": 14, "correlation": 4}),           # outside phases: other
        ("cuda_runtime", "cudaLaunchKernel", 75, 1, {"correlation": 5}),
        ("kernel", "late", 85, 5, {"stream": 14, "correlation": 5}),           # idle 80-85: queued
    ])                                                                         # idle 90-100: launch (end)
    s = analyze_trace(trace)
    assert s.window_ms == pytest.approx(0.1) and s.busy_ms == pytest.approx(0.04)
    assert s.idle_ms == pytest.approx({"launch": 0.02, "data": 0.005, "sync": 0.03, "queued": 0.005})
    assert s.streams["forward"] == {13: [1, pytest.approx(0.01)]}
    assert s.streams["backward"] == {13: [1, pytest.approx(0.01)]}
    assert s.streams["copy HtoD"] == {7: [1, pytest.approx(0.005)]}
    assert s.streams["other"][14][0] == 2
    d = s.to_dict()
    assert d["busy_pct"] == pytest.approx(40) and d["idle_pct"]["sync"] == pytest.approx(30)
    assert "stream 13" in format_summary("deep", s)
    # kernels by GPU time: the three 10-us kernels first, 'late' (5 us) last; copies are not kernels
    assert s.n_kernels == 4 and [n for n, _, _ in s.top_kernels][-1] == "late"
    assert s.top_kernels[0][1:] == (1, pytest.approx(0.01)) and d["top_kernels"][-1]["pct_of_busy"] == pytest.approx(12.5)
    assert "4 kernels in the window" in format_summary("deep", s)
    assert s.families == {"other": (4, pytest.approx(0.035))}  # fwd, bwd, opt, late: no family's names
    assert analyze_trace(_trace([("cpu_op", "aten::mm", 0, 5, {})])) is None


def test_kernel_families_by_name():
    from streamnmt.bench.profile import kernel_family

    assert kernel_family("fmha_cutlassB_bf16_aligned_64x64_k64_sm80") == "attention"  # before cutlass: matmul
    assert kernel_family("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert kernel_family("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN") == "matmul"
    assert kernel_family("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>") == "softmax/reduce"
    assert kernel_family("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>") == \
        "elementwise"
    assert kernel_family("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert kernel_family("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "nccl"
    assert kernel_family("something_else") == "other"


def test_trace_analysis_idle_causes_and_graph_branches():
    trace = _trace([
        ("user_annotation", "bench.window", 0, 100, {}),
        ("user_annotation", "graph.replay", 0, 2, {}),
        ("cuda_runtime", "cudaGraphLaunch", 1, 1, {"correlation": 1}),
        ("kernel", "a", 10, 10, {"stream": 20, "correlation": 1}),  # idle 0-10: launch (host was slow)
        ("kernel", "b", 25, 10, {"stream": 20, "correlation": 1}),  # idle 20-25: queued (launched at 1)
        ("kernel", "c", 35, 5, {"stream": 31, "correlation": 1}),   # a graph branch stream
        ("cuda_runtime", "cudaStreamSynchronize", 50, 5, {}),       # starts after the GPU ran dry
        ("cuda_runtime", "cudaLaunchKernel", 60, 1, {"correlation": 2}),
        ("kernel", "d", 62, 8, {"stream": 20, "correlation": 2}),   # idle 40-62: launch, not sync
    ])
    s = analyze_trace(trace)
    assert s.idle_ms == pytest.approx({"launch": 0.032 + 0.03, "data": 0.0, "sync": 0.0, "queued": 0.005})
    assert s.streams["graph replay"] == {20: [2, pytest.approx(0.02)], -1: [1, pytest.approx(0.005)]}
    assert "graph branches" in format_summary("graph", s)


def test_compile_ro_is_set_apart_from_rows_that_replay_cuda_graphs(monkeypatch):
    from streamnmt.bench.apart import CHILD, rows_apart

    monkeypatch.delenv(CHILD, raising=False)
    assert rows_apart(["plain", "compile-ro", "graph", "resident"]) == ["compile-ro"]
    assert rows_apart(["compile-ro", "resident-graph"]) == ["compile-ro"]
    assert rows_apart(["plain", "compile-ro", "full", "resident"]) == []  # no CUDA graphs beside it
    assert rows_apart(["compile-ro", "graph"], torchrun=True) == []
    monkeypatch.setenv(CHILD, "1")
    assert rows_apart(["compile-ro", "graph"]) == []  # a child never splits again


def test_a_row_set_apart_runs_in_a_child_bench_and_joins_the_table(tmp_path, monkeypatch, capsys):
    """A row that may not share the process (here, for the CPU: plain beside baseline) is measured
    by a child bench of the same settings into OUT/<row>, and its runs join this run's table and
    bench.json, with a note; a child that fails leaves its row out and the run goes on."""
    from streamnmt.bench import apart

    monkeypatch.setattr(apart, "APART", {"plain": frozenset({"baseline"})})
    out = tmp_path / "apart"
    args = ["bench", *SMALL, "--steps", "3", "--strategies", "plain,baseline", "--no-references"]
    assert cli.main([*args, "--out", str(out)]) == 0
    rec = json.loads((out / "bench.json").read_text())
    assert [r["name"] for r in rec["summary"]] == ["plain", "baseline"] and rec["rows"] == ["plain", "baseline"]
    plain = rec["runners"]["plain"]
    child = json.loads((out / "plain" / "bench.json").read_text())
    assert child["rows"] == ["plain"] and child["runners"]["plain"]["runs"] == plain["runs"]
    assert len(plain["runs"]) == 2 and "process of its own" in plain["notes"][-1]
    assert "plain runs first, in a process of its own" in capsys.readouterr().out

    monkeypatch.setattr(apart, "config_argv", lambda cfg: ["--repeats", "0"])  # the child refuses its flags
    assert cli.main([*args, "--out", str(tmp_path / "failed")]) == 0
    rec = json.loads((tmp_path / "failed" / "bench.json").read_text())
    assert [r["name"] for r in rec["summary"]] == ["baseline"]
    assert any(n.startswith("plain left out: its own process ended with exit code 2") for n in rec["left_out"])
