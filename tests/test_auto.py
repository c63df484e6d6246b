"""``--sync-strategy auto``, ``--compile auto``, the padding report and token-budget batches (CPU)."""

from __future__ import annotations

import pytest
import torch
import yaml

from streamnmt import cli
from streamnmt.config import build_job
from streamnmt.data import DataConfig, batch_plan, make_loader, prepare_data
from streamnmt.engine import EngineConfig
from streamnmt.engine.auto import COMPILE_S_PER_SHAPE, choose_compile, choose_strategy
from streamnmt.errors import ConfigError
from tests.conftest import single_thread

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path_factory.getbasetemp() / "home"))
    with single_thread():
        yield


def test_auto_strategy_by_device():
    assert choose_strategy("auto", CUDA).value == "graph"
    assert choose_strategy("auto", CPU).value == "full"
    assert choose_strategy("deep", CUDA).value == "deep"


def test_compile_auto_rule():
    # Two extremes of the rule: a long run of one shape compiles, a short run of many does not.
    long_run = choose_compile("auto", CUDA, "graph", planned_steps=10**7, n_shapes=1)
    short_run = choose_compile("auto", CUDA, "graph", planned_steps=100, n_shapes=16)
    assert long_run.value is True and short_run.value is False and "--compile on" in short_run.why
    # the threshold moves with the number of shapes to compile
    steps = 10**6
    few = choose_compile("auto", CUDA, "graph", planned_steps=steps, n_shapes=1).value
    many = choose_compile("auto", CUDA, "graph", planned_steps=steps, n_shapes=int(10**4 / COMPILE_S_PER_SHAPE)).value
    assert few and not many
    assert choose_compile("auto", CUDA, "full", planned_steps=10**9, n_shapes=1).value is False
    assert choose_compile("auto", CPU, "graph", planned_steps=10**9, n_shapes=1).value is False
    assert choose_compile("on", CPU, "full", 1, 1).value is True and choose_compile("off", CUDA, "graph", 10**9, 1).value is False


def test_compile_auto_for_a_run_with_no_end_names_its_plateau_not_a_duration():
    """A run given no end has only a bound on its steps (the unlimited epochs): it compiles, and the
    line says it trains until its plateau rather than a run of thousands of minutes; a --time-limit
    still caps it to what the limit leaves."""
    plateau = choose_compile("auto", CUDA, "graph", planned_steps=10**11, n_shapes=1, open_ended=True)
    assert plateau.value is True and "until its plateau" in plateau.why and " min (" not in plateau.why
    capped = choose_compile("auto", CUDA, "graph", planned_steps=10**11, n_shapes=1, time_limit_s=60,
                            open_ended=True)
    assert capped.value is False and "~1 min" in capped.why
    assert choose_compile("auto", CPU, "graph", 10**11, 1, open_ended=True).value is False


def test_compile_auto_turns_on_for_a_packed_base_run_of_ten_minutes():
    """The step time follows the tokens a step holds and the model's size: one packed shape of the
    base model at the GPU default budget compiles for a 10-minute run (and a 7-minute one: the
    measured saving wins 34 s back twice in ~6 minutes), not for a 5-minute or 3-minute one (nor
    when --time-limit cuts the run to 3 minutes); a tiny model's steps stay at the floor."""
    from streamnmt.engine.auto import GRAPH_MS_PER_STEP, graph_step_s

    step = graph_step_s(8192)  # base model
    assert 0.01 < step < 0.04 and graph_step_s(16384) == pytest.approx(2 * step)
    assert graph_step_s(8192, n_layers=2, d_model=64, d_ff=128) == GRAPH_MS_PER_STEP / 1e3
    assert graph_step_s(8192, n_layers=12, d_model=1024, d_ff=4096) > 7 * step  # a big model's steps are longer
    ten_min, three_min = int(600 / step), int(180 / step)
    assert choose_compile("auto", CUDA, "graph", ten_min, 1, step).value is True
    assert choose_compile("auto", CUDA, "graph", three_min, 1, step).value is False
    assert choose_compile("auto", CUDA, "graph", int(420 / step), 1, step).value is True
    assert choose_compile("auto", CUDA, "graph", int(300 / step), 1, step).value is False
    cut = choose_compile("auto", CUDA, "graph", ten_min, 1, step, time_limit_s=180)
    assert cut.value is False and "~3 min" in cut.why
    assert f"(~{round(180 / step):,} steps of" in cut.why  # the steps in those 3 minutes, not the epochs'
    assert f"(~{ten_min:,} steps of" in choose_compile("auto", CUDA, "graph", ten_min, 1, step).why


def test_compile_auto_with_a_warm_cache_compiles_a_run_of_a_minute_and_a_quarter():
    """The compile time is the caller's: from a warm compile cache it is a fraction of the cold one,
    so a packed base-model run of 75 s to 3 minutes compiles, which a cold cache leaves eager; a run
    of 20 s stays eager either way, and each shape still counts."""
    from streamnmt.engine.auto import COMPILE_S_PER_SHAPE_WARM, graph_step_s

    assert COMPILE_S_PER_SHAPE_WARM < COMPILE_S_PER_SHAPE / 2
    step = graph_step_s(8192)
    for seconds in (75, 120, 180):
        steps = int(seconds / step)
        warm = choose_compile("auto", CUDA, "graph", steps, 1, step, compile_s=COMPILE_S_PER_SHAPE_WARM)
        cold = choose_compile("auto", CUDA, "graph", steps, 1, step, compile_s=COMPILE_S_PER_SHAPE)
        assert warm.value is True and f"~{COMPILE_S_PER_SHAPE_WARM:.0f} s of compiling" in warm.why
        assert cold.value is False and choose_compile("auto", CUDA, "graph", steps, 1, step).value is False
    warm_s = COMPILE_S_PER_SHAPE_WARM
    assert choose_compile("auto", CUDA, "graph", int(20 / step), 1, step, compile_s=warm_s).value is False
    assert choose_compile("auto", CUDA, "graph", int(120 / step), 4, step, compile_s=warm_s).value is False


def test_compile_flag_values():
    assert EngineConfig(compile=True).compile == "on" and EngineConfig(compile="false").compile == "off"
    with pytest.raises(ConfigError, match="--compile"):
        EngineConfig(compile="fast")
    args = vars(cli.build_parser().parse_args(["train", "--compile"]))
    assert args["compile"] == "on"
    assert build_job({"compile": args["compile"]}).engine.compile == "on"
    assert build_job({}).engine.sync_strategy == "auto" and build_job({}).engine.compile == "auto"


def test_cpu_run_picks_full_and_says_why(tmp_path, capsys):
    code = cli.main(["train", "--device", "cpu", "--model", "tiny", "--builtin-size", "300", "--epochs", "1",
                     "--max-steps", "3", "--bleu-samples", "0", "--workers", "0", "--batch-size", "16",
                     "--project", str(tmp_path), "--name", "auto"])
    out = capsys.readouterr().out
    assert code == 0
    assert "engine: strategy full (auto: no CUDA graphs on cpu" in out
    assert "engine: compile off (auto:" in out and "padding" in out
    cfg = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())
    assert cfg["engine"]["sync_strategy"] == "full" and cfg["engine"]["compile"] == "off"  # resolved values
    header = (tmp_path / "auto" / "results.csv").read_text().splitlines()[0].split(",")
    assert "tokens_per_s" in header and "padded_tokens_per_s" in header


def test_max_tokens_batches_respect_the_budget():
    cfg = DataConfig(builtin_size=400, max_tokens=200, max_len=64, pad_multiple=8, pack=False)
    bundle = prepare_data(cfg, log=lambda s: None)
    loader = make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=False)
    seen = 0
    for batch in loader:
        b, length = batch.src.shape
        assert b * length <= 200 and batch.tgt_in.shape == (b, length)
        assert batch.ntokens == int((batch.tgt_out != 0).sum())  # real tokens, as the reports count them
        seen += 1
    n, shapes = batch_plan(bundle.train, cfg)
    assert seen == n == len(loader) and len(shapes) >= 2
    # padding share = 1 - real / padded target positions, checked against the batches themselves
    real = padded = 0
    for batch in make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=False):
        real += batch.ntokens
        padded += batch.tgt_out.numel()
    fill = loader.num_tokens()["tgt_fill"]  # what the start line reports as 1 - fill
    assert 1 - fill == pytest.approx(1 - real / padded) and 0 < fill < 1
