"""The default batch and warm-up (streamnmt.config's recipe rules and training.recipe.resolve_recipe)."""

from __future__ import annotations

import types

import pytest
import torch

from streamnmt.config import TIME_TO_BLEU_TOKENS, ModelConfig, OptimConfig, recipe_budget, recipe_max_tokens, recipe_warmup
from streamnmt.data.config import DataConfig
from streamnmt.training.step import noam_lr
from streamnmt.training.recipe import resolve_recipe


def test_token_budget_follows_gpu_memory_and_width():
    assert recipe_max_tokens(139.8, 512) == 8192  # one H200, base model
    assert recipe_max_tokens(80, 512) == 4096 and recipe_max_tokens(24, 512) == 1024
    assert recipe_max_tokens(139.8, 1024) == 4096  # twice as wide: half the tokens
    assert recipe_max_tokens(139.8, 64) == 16384 and recipe_max_tokens(4, 512) == 1024  # clamped


def test_default_budget_is_the_time_to_bleu_one_where_memory_allows():
    assert TIME_TO_BLEU_TOKENS == 4096  # the measured winner (docs/PERFORMANCE.md); the cases below follow it
    assert recipe_budget(139.8, 512) == 4096 and recipe_budget(80, 512) == 4096  # H200 and H100, base
    assert recipe_budget(24, 512) == 1024 and recipe_budget(80, 1024) == 2048  # memory decides below it
    assert recipe_budget(139.8, 64) == 4096  # a narrow model on a large GPU: still the time-to-BLEU budget


def test_warmup_spans_the_reference_tokens_and_the_peak_grows_with_the_root_of_the_batch():
    assert recipe_warmup(6144) == 800  # the measured best hand-set flags
    assert recipe_warmup(8192) == 600 and recipe_warmup(16384) == 300
    assert recipe_warmup(10 ** 6) == 100 and recipe_warmup(64) == 4000  # clamped
    peak = {t: noam_lr(recipe_warmup(t), 512, recipe_warmup(t), 1.0) for t in (4096, 16384)}
    assert peak[16384] / peak[4096] == pytest.approx(2.0, rel=0.02)


def _resolver(device: str, world: int = 1):
    lines: list[str] = []
    return (lambda data, optim, model, accum=1: resolve_recipe(data, optim, model, accum, torch.device(device), world,
                                                               lines.append)), lines


def test_gpu_defaults_are_a_device_sized_budget_with_its_warmup(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(total_memory=int(139.8 * 2 ** 30)))
    resolve, lines = _resolver("cuda:0", world=2)
    model = ModelConfig().resolve("base")
    data, optim = resolve(DataConfig(), OptimConfig(), model, accum=2)
    assert data.max_tokens == 4096 and optim.warmup == recipe_warmup(4096 * 4)  # 2 ranks x 2 micro-batches
    assert len(lines) == 1 and lines[0].startswith("recipe: --max-tokens 4096 (auto: the best time to BLEU measured, "
                                                   "within the 8192 that 64 per GiB of the GPU's 140 GiB")
    assert "--warmup" in lines[0]
    # a GPU whose memory holds less: the memory rule, and the line says the cap it stays under
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(total_memory=24 * 2 ** 30))
    resolve, lines = _resolver("cuda:0")
    data, _ = resolve(DataConfig(), OptimConfig(), ModelConfig().resolve("base"))
    assert data.max_tokens == 1024 and "GPU's 24 GiB" in lines[0] and "at most 4096, the best time to BLEU" in lines[0]
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(total_memory=int(139.8 * 2 ** 30)))
    # explicit flags are kept; the warm-up still follows the given budget
    resolve, lines = _resolver("cuda:0")
    data, optim = resolve(DataConfig(max_tokens=6144), OptimConfig(), model)
    assert data.max_tokens == 6144 and optim.warmup == 800 and "--max-tokens" not in lines[0]
    lines.clear()
    data, optim = resolve(DataConfig(max_tokens=6144), OptimConfig(warmup=123), model)
    assert optim.warmup == 123 and lines == []
    data, optim = resolve(DataConfig(max_tokens=0), OptimConfig(), model)  # sentences on a GPU, as asked
    assert data.max_tokens == 0 and optim.warmup == 4000


def test_cpu_defaults_stay_small():
    resolve, lines = _resolver("cpu")
    data, optim = resolve(DataConfig(), OptimConfig(), ModelConfig().resolve("small"))
    assert data.max_tokens == 0 and data.batch_size == 64 and optim.warmup == 400
    assert lines == ["recipe: --batch-size 64 (auto: sentences a batch on the CPU)"]
    lines.clear()  # given, or not counted in sentences: kept and not said
    data, _ = resolve(DataConfig(batch_size=32), OptimConfig(), ModelConfig().resolve("small"))
    assert data.batch_size == 32 and lines == []
    data, _ = resolve(DataConfig(max_tokens=512), OptimConfig(warmup=100), ModelConfig().resolve("small"))
    assert data.batch_size == 64 and lines == []


def test_sentence_batches_on_a_gpu_keep_the_seed_trainers_32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(total_memory=24 * 2 ** 30))
    resolve, lines = _resolver("cuda:0")
    data, _ = resolve(DataConfig(max_tokens=0), OptimConfig(), ModelConfig().resolve("base"))
    assert data.batch_size == 32 and not any("--batch-size" in line for line in lines)
    assert DataConfig().sentences == 32 and DataConfig(batch_size=8).sentences == 8  # unresolved: the GPU's


@pytest.mark.gpu
def test_the_real_gpu_gets_its_budget_in_one_start_line():
    resolve, lines = _resolver("cuda:0")
    data, optim = resolve(DataConfig(), OptimConfig(), ModelConfig().resolve("base"))
    gib = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    assert data.max_tokens == recipe_budget(gib, 512) and optim.warmup == recipe_warmup(data.max_tokens)
    if "H100" in torch.cuda.get_device_name(0) or "H200" in torch.cuda.get_device_name(0):
        assert (data.max_tokens, optim.warmup) == (4096, 1200)
    assert len(lines) == 1 and f"--max-tokens {data.max_tokens}" in lines[0] and f"--warmup {optim.warmup}" in lines[0]


def test_big_model_gets_half_the_budget_and_the_warmup_of_its_tokens(monkeypatch):
    """--model big (d_model 1024) on one H200: 4096 tokens (the memory rule's half of base's 8192, as
    the width doubles; base stays at the time-to-BLEU budget, 4096 too),
    and the warm-up spans the same tokens: 1200 steps, twice base's 600 (not scaled by d_model)."""
    from streamnmt.training import recipe
    monkeypatch.setattr(recipe, "device_memory_gib", lambda device: 139.8)
    resolve, lines = _resolver("cuda:0")
    data, optim = resolve(DataConfig(), OptimConfig(), ModelConfig().resolve("big"))
    assert (data.max_tokens, optim.warmup) == (4096, 1200)
    assert "--max-tokens 4096" in lines[0] and "x 512/1024" in lines[0]


def test_a_peak_learning_rate_given_as_the_noam_factor_is_warned_of():
    # fairseq's --lr 5e-4 is a peak; here --lr multiplies d_model^-0.5 * warmup^-0.5 (a peak ~1e-8)
    resolve, lines = _resolver("cpu")
    model = ModelConfig().resolve("small")
    _, optim = resolve(DataConfig(), OptimConfig(lr=5e-4), model)
    (line,) = [line for line in lines if line.startswith("warning: --lr")]
    unit = noam_lr(optim.warmup, model.d_model, optim.warmup, 1.0)
    assert f"its peak (step {optim.warmup}) is {5e-4 * unit:.2e}" in line and f"--lr {5e-4 / unit:.3g} here" in line
    resolve, lines = _resolver("cpu")
    resolve(DataConfig(), OptimConfig(lr=2.0), model)
    assert not [line for line in lines if line.startswith("warning")]
