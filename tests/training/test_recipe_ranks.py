"""One resolved job for all ranks (CPU, gloo, two processes): rank 0 resolves the 'auto' settings
and every rank runs its job, whatever its own device would have chosen; a rank whose device cannot
run that job stops every rank with one line naming it and the setting (a fresh run and a resumed
one alike). The device queries are patched per rank, as GPUs of two kinds would answer them."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from streamnmt.config import build_job, recipe_max_tokens
from streamnmt.training import recipe
from streamnmt.training.recipe import RankDevice, device_error, resolve_job
from tests.test_dist import free_port

# Rank 0 sees 8 GiB, rank 1 4 GiB: for the tiny model (d_model 64) the recipe sizes 4096 and 2048
# tokens; rank 1 has no native bf16 where rank 0 has it.
GIB = {0: 8.0, 1: 4.0}
FLAGS = {"device": "cpu", "model": "tiny", "builtin_size": "2000", "bleu_samples": "0", "max_len": "32",
         "workers": "0", "dist_backend": "gloo", "dist_timeout": "30"}


def _rank(rank: int, ports: list[int], out: str) -> None:
    """One rank, in one process for both cases (a Trainer built from the same flags as the other
    rank's, with --amp auto, then --amp bf16), on a device that claims GIB[rank] of memory and bf16
    on rank 0 only; writes what it resolved, or the error it stopped with, to out/AMP/rank{rank}."""
    torch.set_num_threads(1)
    import torch.distributed as tdist

    from streamnmt import dist
    from streamnmt.errors import ConfigError
    from streamnmt.training import recipe
    from streamnmt.training.trainer import Trainer

    recipe.device_memory_gib = lambda device: GIB[rank]  # this process only (forked)
    recipe.device_bf16 = lambda device: rank == 0
    for amp, port in zip(("auto", "bf16"), ports):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        where = Path(out) / amp
        flags = {**FLAGS, "amp": amp, "project": str(where / "runs"), "name": "r"}
        result: dict = {}
        try:
            job = Trainer(build_job(flags), log=lambda _: None).job
            result = {"max_tokens": job.data.max_tokens, "warmup": job.optim.warmup, "amp": job.optim.amp,
                      "compile": job.engine.compile, "eval_dtype": job.run.eval_dtype,
                      "attention": job.model.attention, "device": job.run.device}
        except ConfigError as e:
            result["error"] = str(e)
            # A resumed run checks its checkpoint's job the same way (the process group the Trainer
            # joined serves as the control group).
            d = dist.Dist(rank=rank, world=2, local_rank=rank, backend="gloo", device=torch.device("cpu"))
            saved = resolve_job(build_job(flags), torch.device("cpu"), 2, lambda _: None)
            try:
                recipe.resolve_job_for_ranks(saved, torch.device("cpu"), d, lambda _: None, resumed=True)
            except ConfigError as e2:
                result["resume_error"] = str(e2)
        where.mkdir(parents=True, exist_ok=True)
        (where / f"rank{rank}").write_text(json.dumps(result))
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, Any]:
    """Both cases in one start of two processes, forked from the test process (importing the trainer
    would be most of a fresh process's time):
    {"auto": [rank 0's result, rank 1's], "bf16": [...], "out": the directory they ran in}."""
    out = tmp_path_factory.mktemp("ranks")
    old = os.environ.get("STREAMNMT_HOME")
    os.environ["STREAMNMT_HOME"] = str(tmp_path_factory.getbasetemp() / "home")  # the children inherit it
    try:
        torch.multiprocessing.start_processes(_rank, args=([free_port(), free_port()], str(out)), nprocs=2, join=True,
                                              start_method="fork")
    finally:
        if old is None:
            os.environ.pop("STREAMNMT_HOME")
        else:
            os.environ["STREAMNMT_HOME"] = old
    results: dict[str, Any] = {"out": out}
    for amp in ("auto", "bf16"):
        results[amp] = [json.loads((out / amp / f"rank{r}").read_text()) for r in (0, 1)]
    return results


def test_ranks_of_different_memory_run_rank0s_budget(ranks):
    """Each rank alone would pack 4096 and 2048 tokens; both run rank 0's job: its budget, its
    warm-up (from 4096 x 2 ranks), its compile choice, each on its own device."""
    assert recipe_max_tokens(GIB[0], 64) == 4096 and recipe_max_tokens(GIB[1], 64) == 2048
    r0, r1 = ranks["auto"]
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["max_tokens"] == r1["max_tokens"] == 4096
    assert r0 == r1 and r0["compile"] in ("on", "off") and r0["eval_dtype"] != "auto" and r0["attention"] == "sdpa"


def test_a_rank_without_bf16_stops_every_rank_with_one_line(ranks):
    """rank 0 has native bf16 and the job is bf16; rank 1 has none: both ranks raise the same line,
    naming rank 1 and --amp, before anything is written; a resumed bf16 job stops alike."""
    r0, r1 = ranks["bf16"]
    assert r0["error"] == r1["error"], (r0, r1)
    assert r0["error"].startswith("--amp (config key 'amp'): bf16, native on rank 0, but rank 1 of 2 (cpu) has no "
                                  "native bf16")
    assert r0["resume_error"] == r1["resume_error"] == r0["error"] + recipe.RESUME_HINT
    assert not (ranks["out"] / "bf16" / "runs").exists()


# -- the per-rank rule, without processes -----------------------------------------------------------

def _dev(gib: float | None, bf16: bool = True, flex: str | None = None) -> RankDevice:
    return RankDevice("cuda:1, GPU", gib, bf16, flex)


def _job(max_tokens: int, amp: str = "bf16", attention: str = "sdpa"):
    return resolve_job(build_job({"device": "cpu", "model": "base", "max_tokens": str(max_tokens), "amp": amp,
                                  "attention": attention}), torch.device("cpu"), 2, lambda _: None)


def test_budget_rule_fails_only_a_smaller_gpu_past_twice_its_own_budget():
    h200, h100, a100_40 = _dev(139.8), _dev(79.6), _dev(39.5)
    assert device_error(_job(8192), h100, h200, 1, 2) is None  # half rank 0's memory: 2 x 4096 covers 8192
    err = device_error(_job(8192), a100_40, h200, 1, 2)
    assert err is not None and err.startswith("--max-tokens (config key 'max_tokens'): 8192 tokens per batch")
    assert "rank 1 of 2 (cuda:1, GPU) has 40 GiB" in err and "--max-tokens 4096 or less" in err
    assert device_error(_job(32768), h200, h200, 1, 2) is None  # GPUs of one size: the user's budget stands
    assert device_error(_job(4096), a100_40, h200, 1, 2) is None  # within twice its own 2048
    assert device_error(_job(8192), _dev(None), _dev(None), 1, 2) is None  # CPU ranks: no memory rule


def test_bf16_and_flex_rules_fail_only_where_rank0_can():
    assert "--amp" in device_error(_job(0), _dev(80, bf16=False), _dev(80), 1, 2)
    assert device_error(_job(0), _dev(80, bf16=False), _dev(80, bf16=False), 1, 2) is None  # alike: as asked
    assert device_error(_job(0, amp="fp16"), _dev(80, bf16=False), _dev(80), 1, 2) is None
    flex = _job(0, attention="flex")  # resolved on the CPU: flex is unavailable there, so sdpa
    assert flex.model.attention == "sdpa"
    flex = dataclasses.replace(flex, model=dataclasses.replace(flex.model, attention="flex"))
    err = device_error(flex, _dev(80, flex="no FlexAttention in this torch"), _dev(80), 1, 2)
    assert err.startswith("--attention (config key 'attention'): flex, which rank 0 runs, but rank 1 of 2")
    triton = dataclasses.replace(flex, model=dataclasses.replace(flex.model, attention="triton"))
    no_build = RankDevice("cuda:1, GPU", 80, True, None, "the Triton kernels do not build here (RuntimeError: x)")
    err = device_error(triton, no_build, _dev(80), 1, 2)
    assert err.startswith("--attention (config key 'attention'): triton, which rank 0 runs, but rank 1 of 2")
    assert "do not build here" in err and err.endswith("set --attention sdpa")
    assert device_error(triton, no_build, no_build, 1, 2) is None  # alike: every rank falls back the same way
    assert RankDevice(**{"name": "cuda:0, GPU", "gib": 80.0, "bf16": True, "flex": None}).triton is None  # older record


def test_a_resume_is_checked_against_the_device_the_run_started_on(tmp_path, monkeypatch):
    """One process resuming a checkpoint sized on a larger, bf16 GPU: its own device is checked
    against that one (recipe_device, saved in every checkpoint), as every rank is on several."""
    from streamnmt.dist import Dist
    from streamnmt.errors import ConfigError
    from streamnmt.training import recipe
    from tests.test_recipe import make_trainer

    t = make_trainer(tmp_path, "--name", "r", "--max-steps", "1")
    t.train()
    saved = torch.load(tmp_path / "r" / "weights" / "last.pt", weights_only=True)
    assert RankDevice(**saved["recipe_device"]) == t.run.recipe_device  # the CPU it started on
    one = Dist()  # one process, no process group
    origin = dataclasses.asdict(_dev(139.8))
    monkeypatch.setattr(recipe, "device_memory_gib", lambda device: 39.5)
    monkeypatch.setattr(recipe, "device_bf16", lambda device: True)
    job, first = recipe.resolve_job_for_ranks(_job(4096), torch.device("cpu"), one, lambda _: None, resumed=True,
                                              origin=origin)
    assert job.data.max_tokens == 4096 and first == _dev(139.8)  # within twice its own 2048
    with pytest.raises(ConfigError, match=r"sized for the GPU this run started on \(140 GiB\), but rank 0 of 1"):
        recipe.resolve_job_for_ranks(_job(8192), torch.device("cpu"), one, lambda _: None, resumed=True,
                                     origin=origin)
    monkeypatch.setattr(recipe, "device_bf16", lambda device: False)
    with pytest.raises(ConfigError, match="--amp .*bf16, native on the GPU this run started on"):
        recipe.resolve_job_for_ranks(_job(0), torch.device("cpu"), one, lambda _: None, resumed=True, origin=origin)
    # a checkpoint of an earlier version (no recipe_device): nothing to check against
    assert recipe.resolve_job_for_ranks(_job(16384), torch.device("cpu"), one, lambda _: None, resumed=True)[0]
