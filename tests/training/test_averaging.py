"""--average-last: the mean of the last K evaluated weights, scored at the end of the run beside the
best single evaluation; best.pt is the winner, and a resumed run ends as the uninterrupted one."""

from __future__ import annotations

import contextlib

import pytest
import torch

from streamnmt.checkpoint import load_checkpoint, load_safetensors, safetensors_metadata
from streamnmt.errors import ConfigError
from streamnmt.training import averaging
from streamnmt.training.averaging import Averager, choose, end_line
from streamnmt.training.evaluator import Evaluator
from streamnmt.training.runs import read_csv
from streamnmt.training.trainer import Trainer
from tests.test_recipe import home, make_trainer  # noqa: F401  (home: each test's STREAMNMT_HOME)

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")


def states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` state dicts as a model has them: float weights, a tied pair (one tensor under two
    keys) and an integer buffer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tied = torch.randn(5, 3, generator=g)
        out.append({"w": torch.randn(4, 6, generator=g) * (i + 1), "b": torch.randn(6, generator=g),
                    "src_embed": tied, "tgt_embed": tied, "count": torch.tensor([i, 10 * i])})
    return out


def test_the_mean_is_the_element_wise_mean_of_the_last_k_evaluations():
    avg = Averager(3, CPU)
    made = states(5)
    last = [{k: v.clone() for k, v in s.items()} for s in made[2:]]
    for step, state in enumerate(made, start=1):
        avg.add(10 * step, state)
        state["w"].add_(100.0)  # the evaluated weights train on: the averager kept a copy
    assert avg.steps == [30, 40, 50]  # a ring: only the last 3
    got = avg.mean()
    for key in ("w", "b", "src_embed"):
        want = torch.stack([s[key].double() for s in last]).mean(0).float()
        assert got[key].dtype == torch.float32 and torch.equal(got[key], want), key
        torch.testing.assert_close(got[key], torch.stack([s[key] for s in last]).mean(0))
    assert got["src_embed"] is got["tgt_embed"]  # tied weights stay one tensor
    assert torch.equal(got["count"], made[-1]["count"])  # not floating point: the last evaluation's
    assert not torch.equal(got["w"], last[-1]["w"])


def test_the_same_step_again_replaces_its_copy_and_the_state_round_trips():
    avg = Averager(2, CPU)
    a, b, c = states(3, seed=1)
    avg.add(5, a)
    avg.add(7, b)
    avg.add(7, c)  # evaluated again at the same step: one entry, the newer weights
    avg.scored(7, 1.5)
    assert avg.steps == [5, 7]
    state = avg.state_dict()
    back = Averager(2, CPU)
    back.load_state_dict(state)
    assert back.steps == [5, 7] and back.last == (7, 1.5)
    for key, want in avg.mean().items():
        assert torch.equal(back.mean()[key], want)
    assert torch.equal(back.mean()["w"], (a["w"].double() + c["w"].double()).div(2).float())
    other = Averager(2, CPU, keep=False)  # a rank that keeps no copies counts the steps alike
    other.load_state_dict({**state, "ring": None})
    assert other.steps == [5, 7] and other.ring == []


def test_the_winner_is_chosen_by_dev_score_and_a_tie_keeps_the_single_evaluation():
    assert choose("bleu", 30.2, 30.1) == "average"
    assert choose("bleu", 30.1, 30.1) == "single"  # a tie: the single evaluation, already on disk
    assert choose("bleu", 29.0, 30.1) == "single"
    assert choose("val_loss", 2.9, 3.0) == "average" and choose("val_loss", 3.1, 3.0) == "single"
    assert choose("bleu", float("nan"), 1.0) == "single" and choose("bleu", None, None) == "single"
    assert choose("bleu", 0.5, None) == "average"  # no single evaluation scored
    line = end_line("bleu", "average", 5, [500, 900], 53.1, False, 52.7, 900, 52.9)
    assert line == "best.pt: average of the last 5 evaluations, steps 500-900 (dev BLEU 53.10; best single " \
                   "52.70 at step 900; EMA 52.90)"
    assert end_line("val_loss", "single", 3, [1, 3], 3.2, False, 3.1, 3, None).startswith(
        "best.pt: the best single evaluation, step 3 (validation loss 3.1000; average of")


def test_a_better_best_pt_on_disk_must_be_beaten_by_the_mean_too():
    """A resume's best.pt may hold a better model than the run's best single evaluation: the mean
    replaces it only where it beats that one as well; a cut BLEU pass is never compared."""
    assert averaging.decide("bleu", 31.0, False, 30.0, None) == ("average", None)
    assert averaging.decide("bleu", 31.0, False, 30.0, 32.0) == ("single", 32.0)  # best.pt keeps its model
    assert averaging.decide("bleu", 33.0, False, 30.0, 32.0) == ("average", 32.0)
    assert averaging.decide("bleu", 31.0, False, 30.0, 29.0) == ("average", None)  # the run's best is better
    assert averaging.decide("val_loss", 2.0, False, 3.0, 2.5) == ("average", 2.5)
    assert averaging.decide("bleu", 99.0, True, 30.0, None) == ("single", None)


def test_average_last_one_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="average.last.*at least 2"):
        make_trainer(tmp_path, "--average-last", "1")


FLAGS = ("--epochs", "2", "--eval-every", "4", "--best-metric", "val_loss", "--average-last", "3")


@pytest.fixture
def average_wins(monkeypatch):
    """The mean scores 1.0 below its real validation loss (so it wins); every other validation
    records the weights it scored, in order."""
    scored: list[tuple[int, dict[str, torch.Tensor]]] = []
    in_mean = [False]
    real_loaded, real_validate = averaging.loaded, Evaluator.validate

    @contextlib.contextmanager
    def loaded(model, weights):
        with real_loaded(model, weights):
            in_mean[0] = True
            try:
                yield
            finally:
                in_mean[0] = False

    def validate(self):
        if in_mean[0]:
            return real_validate(self) - 1.0
        scored.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return real_validate(self)

    monkeypatch.setattr(averaging, "loaded", loaded)
    monkeypatch.setattr(Evaluator, "validate", validate)
    return scored


def test_a_winning_average_is_best_pt_and_the_end_line_says_so(tmp_path, average_wins):
    lines: list[str] = []
    t = make_trainer(tmp_path, "--name", "a", *FLAGS, lines=lines)
    t.train()
    w = tmp_path / "a" / "weights"
    best = load_checkpoint(w / "best.pt")
    evals = read_csv(tmp_path / "a" / "evals.csv")
    assert len(average_wins) == len(evals) - 1 >= 3  # one validation per evaluation, then the mean's
    want = {k: torch.stack([s[k].double() for s in average_wins[-3:]]).mean(0).float() for k in average_wins[-1]}
    assert best["model"].keys() == want.keys() and all(torch.equal(best["model"][k], want[k]) for k in want)
    assert not torch.equal(best["model"]["generator.weight"], average_wins[-1]["generator.weight"])
    steps = [int(r["step"]) for r in evals[-4:-1]]
    assert best["best"]["averaged"] == steps and best["best"]["value"] == pytest.approx(float(evals[-1]["val_loss"]))
    assert evals[-1]["kind"] == "average" and evals[-1]["best"] == "1" and evals[-1]["step"] == evals[-2]["step"]
    assert all(r["kind"] == "" for r in evals[:-1])
    st = load_safetensors(w / "best.safetensors")
    assert all(torch.equal(st[k], best["model"][k]) for k in want)
    assert safetensors_metadata(w / "best.safetensors")["weights_id"] == best["weights_id"]
    said = [line for line in lines if line.startswith("best.pt:")]
    assert said == [f"best.pt: average of the last 3 evaluations, steps {steps[0]}-{steps[-1]} (validation loss "
                    f"{float(evals[-1]['val_loss']):.4f}; best single {t.evaluator.stopper.best:.4f} at step "
                    f"{t.evaluator.stopper.best_step}; EMA {float(evals[-2]['val_loss']):.4f})"]
    last = load_checkpoint(w / "last.pt")
    assert last["averager"]["steps"] == steps and last["averager"]["decided"]["line"] == said[0]


def test_a_losing_average_leaves_the_best_single_evaluation(tmp_path, monkeypatch):
    real_loaded, real_validate = averaging.loaded, Evaluator.validate
    in_mean = [False]

    @contextlib.contextmanager
    def loaded(model, weights):
        with real_loaded(model, weights):
            in_mean[0] = True
            yield
        in_mean[0] = False

    monkeypatch.setattr(averaging, "loaded", loaded)
    monkeypatch.setattr(Evaluator, "validate", lambda self: real_validate(self) + (9.0 if in_mean[0] else 0.0))
    lines: list[str] = []
    t = make_trainer(tmp_path, "--name", "b", *FLAGS, lines=lines)
    t.train()
    best = load_checkpoint(tmp_path / "b" / "weights" / "best.pt")
    assert "averaged" not in best["best"] and best["best"]["step"] == t.evaluator.stopper.best_step
    evals = read_csv(tmp_path / "b" / "evals.csv")
    assert evals[-1]["kind"] == "average" and evals[-1]["best"] == "0"
    assert any(line.startswith(f"best.pt: the best single evaluation, step {best['best']['step']}") for line in lines)


def test_a_resumed_run_ends_with_the_average_of_the_uninterrupted_one(tmp_path, monkeypatch, average_wins):
    """A signal after step 26 (not an evaluation step; the run evaluates every 4 steps, at epoch
    ends and at its end, step 28): last.pt carries the kept weights, two of which the end's mean
    takes; the resumed run's end scores the same mean and writes the same best.pt and evals.csv."""
    make_trainer(tmp_path, "--name", "ref", *FLAGS).train()
    real = Trainer._trained

    def trained(self, seconds):
        real(self, seconds)
        if self.global_step == 26 and not self.stop_requested:
            self.signalled = self.stop_requested = True

    monkeypatch.setattr(Trainer, "_trained", trained)
    make_trainer(tmp_path, "--name", "cut", *FLAGS).train()
    monkeypatch.setattr(Trainer, "_trained", real)
    cut = tmp_path / "cut" / "weights"
    held = load_checkpoint(cut / "last.pt")
    assert held["step"] == 26 and held["averager"]["steps"] == [16, 20, 24] and len(held["averager"]["ring"]) == 3
    assert held["averager"]["decided"] is None and read_csv(tmp_path / "cut" / "evals.csv")[-1]["kind"] == ""
    Trainer.from_checkpoint(str(cut / "last.pt"), log=lambda _: None).train()
    cols = ("step", "epoch", "val_loss", "best", "kind")
    rows = [[{c: r[c] for c in cols} for r in read_csv(tmp_path / name / "evals.csv")] for name in ("cut", "ref")]
    assert rows[0] == rows[1] and rows[0][-1]["kind"] == "average" and rows[0][-1]["step"] == "28"
    got, want = load_checkpoint(cut / "best.pt"), load_checkpoint(tmp_path / "ref" / "weights" / "best.pt")
    assert got["best"] == want["best"] and "averaged" in got["best"]
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    a, b = load_checkpoint(cut / "last.pt")["averager"], load_checkpoint(tmp_path / "ref" / "weights" / "last.pt")["averager"]
    assert a["steps"] == b["steps"] and a["decided"] == b["decided"]
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a["ring"], b["ring"]) for k in x)



@pytest.mark.gpu
def test_on_a_gpu_the_copies_go_to_pinned_host_memory_and_average_exactly():
    """The copies are queued on the current stream into pinned buffers; the mean waits for them
    through the one counted host sync and equals the element-wise mean of the device weights."""
    dev = torch.device("cuda")
    avg = Averager(2, dev)
    made = [{k: v.to(dev) for k, v in s.items()} for s in states(3, seed=2)]
    for step, state in enumerate(made):
        avg.add(step, state)
    assert all(t.is_pinned() and t.device.type == "cpu" for copy in avg.ring for t in copy.values())
    want = torch.stack([s["w"].double() for s in made[1:]]).mean(0).float().cpu()
    assert torch.equal(avg.mean()["w"], want)


def _ending_loop(steps: list[int], lines: list[str]):
    """The end of a run as average_at_end reads it: --average-last 3 over ``steps``' kept weights,
    --best-metric bleu, the best single evaluation 30.0 at the last step."""
    from types import SimpleNamespace

    av = Averager(3, CPU)
    for step, state in zip(steps, states(len(steps))):
        av.add(step, state)
    stopper = SimpleNamespace(metric="bleu", best=30.0, best_step=steps[-1])
    return SimpleNamespace(evaluator=SimpleNamespace(averager=av, stopper=stopper), signalled=False,
                           global_step=steps[-1], log=lines.append, drain=lambda _: None, clock=lambda: 0.0,
                           run=SimpleNamespace(wall_s=lambda: 0.0))


def test_a_signal_that_cuts_the_means_pass_leaves_the_choice_to_the_resumed_run(monkeypatch):
    """The mean's BLEU pass cut by a signal is not a decision: nothing written or said, last.pt records
    no choice, and the resumed run scores the mean in full (as a single evaluation a signal cuts)."""
    lines: list[str] = []
    loop = _ending_loop([8, 12, 16], lines)
    cut = averaging.MeanScore(16, 2.0, 41.0, 1.0, 64, 1.0)  # 64 of 200 dev sentences
    monkeypatch.setattr(averaging, "_score_mean", lambda loop, av: (None, cut, 200, True))
    assert averaging.average_at_end(loop) is False
    assert loop.evaluator.averager.decided is None and lines == []


def test_one_evaluation_kept_still_names_what_best_pt_holds():
    lines: list[str] = []
    assert averaging.average_at_end(_ending_loop([16], lines)) is False
    assert lines == ["best.pt: the best single evaluation, step 16 (--average-last 3: one evaluation, nothing to "
                     "average)"]


def test_a_pass_cut_short_is_not_said_beside_the_mean():
    avg = Averager(3, CPU)
    avg.scored(7, 1.5)
    avg.scored(9, None)  # the end's pass cut short: its BLEU is on the longest sentences only
    assert avg.last is None
