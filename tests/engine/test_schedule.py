"""Each strategy's schedule, seen on the CPU through the recording stream manager.

For baseline, event, interval, deep and full (deep and full with 4 and with 3 streams): the host
syncs per 100 steps and where they happen, the stream each phase (copy, forward, backward,
optimizer step, loss push) runs on, and the event each device-side wait is on. The checks compare
against the schedule as the design documents draw it, so any change to a strategy's schedule
fails here (``test_a_changed_schedule_fails_the_checks`` shows that the checks catch changes).
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from streamnmt.engine import STATS, DeferredLosses, EngineConfig, make_strategy
from streamnmt.errors import ConfigError, DeviceError
from tests.engine.streamdouble import Probe, RecordingLosses, RecordingStep, RecordingStreamManager
from tests.engine.test_engine import Regression, make_batches, train

N = 100
SEEDS = ["baseline", "event", "interval"]
PIPES = [("deep", 4), ("deep", 3), ("full", 4), ("full", 3)]
ALL = [(s, None) for s in SEEDS] + PIPES
pytestmark = pytest.mark.usefixtures("one_thread")


def run_recorded(strategy: str, n: int = N, interval: int = 10, streams: int | None = None, answer=None):
    """Run ``strategy`` over ``n`` batches with the recording manager; returns
    (strategy, manager, [(step, loss)], host syncs per site inside the run, the model's step function)."""
    cfg = EngineConfig(sync_strategy=strategy, sync_interval=interval, streams=streams)
    kw = {"answer": answer} if answer is not None else {}
    strat = make_strategy(strategy, "cpu", cfg, log=lambda s: None,
                          manager=lambda device, k: RecordingStreamManager(device, k, **kw))
    sm = strat.sm
    inner = Regression(torch.device("cpu"))
    step = RecordingStep(inner, sm)
    losses = RecordingLosses(DeferredLosses("cpu", 10), sm, step)
    batches = [Probe(i, x, y, sm) for i, (x, y) in enumerate(make_batches(n))]
    STATS.reset()
    got = []
    for _ in strat.run(batches, step, losses):
        got += losses.poll()
    syncs = {site: int(s["count"]) for site, s in STATS.reset().items()}
    return strat, sm, got + losses.flush(), syncs, inner


@functools.lru_cache(maxsize=None)
def recorded(strategy: str, interval: int = 10, streams: int | None = None):
    """``run_recorded`` once per setting (the tests only read what it returns)."""
    return run_recorded(strategy, interval=interval, streams=streams)


@functools.lru_cache(maxsize=None)
def baseline_reference():
    return train("baseline", "cpu", n=N)


# -- what each schedule must be -------------------------------------------------------------------
def expected_syncs(strategy: str, n: int, k: int) -> list[tuple[str, tuple]]:
    """(site, what the host waits on) in order, as the seeds draw each strategy."""
    if strategy == "baseline":  # batch 0: its transfer; every later batch: the previous compute
        return [("baseline.transfer", ("stream", 0))] + [("baseline.compute", ("stream", 1))] * (n - 1)
    if strategy == "event":
        return []
    if strategy == "interval":  # batch 0's transfer; then every k batches (and the last), the newest event
        return [("interval.transfer", ("stream", 0))] + [
            ("interval.compute", ("push", i - 1)) for i in range(1, n) if (i + 1) % k == 0 or i == n - 1]
    return [(f"{strategy}.backward", ("push", i)) for i in range(n) if (i + 1) % k == 0 or i == n - 1]


def expected_streams(strategy: str, streams: int | None, n: int) -> dict[str, dict[int, int]]:
    if strategy in SEEDS:  # stream 0 transfers, stream 1 computes
        return {"copy": dict.fromkeys(range(n), 0),
                **{p: dict.fromkeys(range(n), 1) for p in ("forward", "backward", "optimizer", "push")}}
    copies = (0, 3) if streams == 4 else (0, 0)
    return {"copy": {j: copies[j % 2] for j in range(n)}, "forward": dict.fromkeys(range(n), 1),
            **{p: dict.fromkeys(range(n), 2) for p in ("backward", "optimizer", "push")}}


def expected_waits(strategy: str, n: int) -> dict[tuple, set]:
    """Each phase -> the events its stream waits on just before it."""
    out: dict[tuple, set] = {}
    for i in range(n):
        if strategy in SEEDS:
            out.update({("copy", i): set(), ("forward", i): {("copy", i)}, ("backward", i): set(),
                        ("optimizer", i): set(), ("push", i): set()})
        else:
            # copy j reuses batch j - 2's slot: it waits for that batch only, never for batch j - 1
            out[("copy", i)] = {("push", i - 2)} if i >= 2 else set()
            # forward N: its copy, and the weights of step N - 1
            out[("forward", i)] = {("copy", i)} | ({("push", i - 1)} if i else set())
            out[("backward", i)] = {("forward", i)}
            out[("optimizer", i)] = out[("push", i)] = set()
    return out


def check_schedule(strategy: str, streams: int | None, sm: RecordingStreamManager, n: int, k: int) -> None:
    """Everything a schedule is; raises AssertionError on the first difference."""
    assert sm.n == (streams or (4 if strategy in ("deep", "full") else 2)), sm.n
    for phase, want in expected_streams(strategy, streams, n).items():
        assert sm.phases(phase) == want, (phase, sm.phases(phase))
    got = sm.waits_before()
    for key, want in expected_waits(strategy, n).items():
        assert got[key] == want, (key, got[key], want)
    assert sm.host_syncs() == expected_syncs(strategy, n, k), sm.host_syncs()
    order = [op.what for op in sm.ops if op.kind == "phase"]
    if strategy in ("deep", "full"):  # two batches in flight: copies of N+1 issued before forward N
        for i in range(n - 1):
            assert order.index(("copy", i + 1)) < order.index(("forward", i)), i
        for j in range(2, n):  # ... and of N+2 right after N is issued, before forward N+1
            assert order.index(("push", j - 2)) < order.index(("copy", j)) < order.index(("forward", j - 1)), j
    else:  # one batch at a time: copy N after compute N-1 was issued
        for i in range(1, n):
            assert order.index(("push", i - 1)) < order.index(("copy", i)), i


# -- the tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,streams", ALL)
@pytest.mark.parametrize("interval", [10, 7])
def test_schedule_as_designed(strategy, streams, interval):
    _, sm, got, _, _ = recorded(strategy, interval, streams)
    assert [s for s, _ in got] == list(range(1, N + 1))
    check_schedule(strategy, streams, sm, N, interval)
    # the caller's stream is forked from at the start and after every batch (its work between two
    # batches, e.g. an evaluation, comes first), and joined once at the end
    kinds = [op.kind for op in sm.ops]
    assert kinds.count("fork") == N + 1 and kinds[0] == "fork" and kinds.count("join") == 1 and kinds[-1] == "join"


SYNCS_PER_100 = {  # (strategy, --sync-interval) -> host waits inside 100 steps, per site
    ("baseline", 10): {"baseline.transfer": 1, "baseline.compute": 99},
    ("baseline", 5): {"baseline.transfer": 1, "baseline.compute": 99},
    ("event", 10): {}, ("event", 5): {},
    ("interval", 10): {"interval.transfer": 1, "interval.compute": 10},
    ("interval", 5): {"interval.transfer": 1, "interval.compute": 20},
    ("interval", 7): {"interval.transfer": 1, "interval.compute": 15},
    ("deep", 10): {"deep.backward": 10}, ("deep", 5): {"deep.backward": 20}, ("deep", 7): {"deep.backward": 15},
    ("full", 10): {"full.backward": 10}, ("full", 5): {"full.backward": 20}, ("full", 7): {"full.backward": 15},
}


@pytest.mark.parametrize("strategy,interval,streams", [
    (s, k, n) for s, k in SYNCS_PER_100 for n in ((None, 3) if s in ("deep", "full") else (None,))])
def test_host_syncs_per_100_steps(strategy, interval, streams):
    _, sm, _, syncs, _ = recorded(strategy, interval, streams)
    assert syncs == SYNCS_PER_100[strategy, interval]
    assert len(sm.host_syncs()) == sum(syncs.values())  # every host wait went through host_sync


def test_default_sync_counts_are_the_seeds():
    """With the defaults: baseline 100, event 0, interval 11, deep 10, full 10 per 100 steps."""
    counts = {s: sum(recorded(s)[3].values()) for s in ("baseline", "event", "interval", "deep", "full")}
    assert counts == {"baseline": 100, "event": 0, "interval": 11, "deep": 10, "full": 10}


@pytest.mark.parametrize("strategy,streams", ALL)
def test_recorded_run_equals_baseline(strategy, streams):
    """The double runs the real work: losses and weights equal the plain baseline's, bit for bit."""
    ref, ref_params = baseline_reference()
    _, _, got, _, step = recorded(strategy, 10, streams)
    assert got == ref
    assert all(torch.equal(p.detach(), q) for p, q in zip(step.model.parameters(), ref_params))


def _mutations(sm: RecordingStreamManager) -> list[RecordingStreamManager]:
    """Small changes of a recorded deep schedule, each one a different strategy."""
    out = []

    def mutate(pred, change):
        m = copy.deepcopy(sm)
        op = next(o for o in m.ops if pred(o))
        change(op)
        out.append(m)

    # the copy of batch 5 waits for the backward of batch 4 (the old schedule), not of batch 3
    mutate(lambda o: o.kind == "wait" and o.what == ("push", 3) and o.stream == 3,
           lambda o: setattr(o, "what", ("push", 4)))
    # batch 4 copied on stream 3 instead of 0
    mutate(lambda o: o.kind == "phase" and o.what == ("copy", 4), lambda o: setattr(o, "stream", 3))
    # the backward's own work on the forward stream
    mutate(lambda o: o.kind == "phase" and o.what == ("optimizer", 6), lambda o: setattr(o, "stream", 1))
    # one more host sync
    mutate(lambda o: o.kind == "sync", lambda o: setattr(o, "what", ("deep.backward", ("push", 8))))
    # forward 7 no longer waits for its copy
    mutate(lambda o: o.kind == "wait" and o.what == ("copy", 7), lambda o: setattr(o, "what", ("copy", 6)))
    return out


def test_a_changed_schedule_fails_the_checks():
    _, sm, _, _, _ = recorded("deep", 10, 4)
    check_schedule("deep", 4, sm, N, 10)
    mutants = _mutations(sm)
    assert len(mutants) == 5
    for m in mutants:
        with pytest.raises(AssertionError):
            check_schedule("deep", 4, m, N, 10)


def test_event_counts_not_ready_answers():
    answers = iter([False, True] * N)
    strat, sm, got, _, _ = run_recorded("event", answer=lambda ev: next(answers))
    assert len(got) == N
    assert [op.what for op in sm.ops if op.kind == "query"] == [("push", i) for i in range(N)]
    assert strat.counters() == {"event.queries": N, "event.not_ready": N // 2}
    assert strat.counters() == {"event.queries": 0, "event.not_ready": 0}  # read once per epoch


def test_failed_event_query_ends_the_run_in_one_line():
    def answer(ev):
        if ev.label == ("push", 3):
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")
        return True

    with pytest.raises(DeviceError) as e:
        run_recorded("event", answer=answer)
    msg = str(e.value)
    assert "\n" not in msg and "batch 3" in msg and "illegal memory access" in msg and "event" in msg


def test_streams_setting_is_validated():
    assert make_strategy("deep", "cpu", EngineConfig(sync_strategy="deep")).n_streams == 4
    assert make_strategy("full", "cpu", EngineConfig(sync_strategy="full", streams=3)).n_streams == 3
    for bad in ("baseline", "event", "interval", "graph"):
        with pytest.raises(ConfigError, match="--streams.*deep and full"):
            EngineConfig(sync_strategy=bad, streams=3)
    with pytest.raises(ConfigError, match="--streams.*3 or 4"):
        EngineConfig(sync_strategy="deep", streams=2)
    assert math.isfinite(EngineConfig(sync_strategy="auto", streams=3).streams)  # auto may resolve to full
