"""Packed batches: placement, the batch tensors, global steps across ranks/accumulation, resume."""

from __future__ import annotations

import os

import numpy as np
import pytest

from streamnmt.data import DataConfig, make_loader
from streamnmt.data.corpus import TokenizedCorpus
from streamnmt.data.packbatch import collate_packed
from streamnmt.data.packing import PackSampler
from streamnmt.data.packrows import pack_rows
from streamnmt.data.packshape import pack_shape
from streamnmt.errors import InputError
from streamnmt.models.masks import BOS, EOS, PAD


def corpus_of(pairs: list[tuple[list[int], list[int]]]) -> TokenizedCorpus:
    def side(k: int) -> tuple[np.ndarray, np.ndarray]:
        toks = [np.asarray(p[k], np.int64) for p in pairs]
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in toks])]).astype(np.int64)
        return np.concatenate(toks) if toks else np.zeros(0, np.int64), offsets

    st, so = side(0)
    tt, to = side(1)
    return TokenizedCorpus({"src_tokens": st, "src_offsets": so, "tgt_tokens": tt, "tgt_offsets": to,
                            "index": np.arange(len(pairs), dtype=np.int64)}, name="t")


def random_corpus(n: int, seed: int = 0, longest: int = 14) -> TokenizedCorpus:
    rng = np.random.default_rng(seed)
    return corpus_of([(list(rng.integers(4, 50, rng.integers(1, longest))),
                       list(rng.integers(4, 50, rng.integers(1, longest)))) for _ in range(n)])


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def test_rows_packed_in_forked_processes_equal_rows_packed_in_one(tmp_path, monkeypatch):
    """The windows are independent: packed by 2 forked processes (which did run: each leaves a mark),
    an epoch's rows are the same rows in the same order; a sampler plans in several processes only
    with no other Python thread."""
    import threading

    from streamnmt.data import packrows

    c = random_corpus(3000, seed=4)
    s, t = c.src_lengths + 1, c.tgt_lengths + 1
    one = packrows.epoch_rows(s, t, (8, 40, 32), True, 5, 2, window=256)
    work = packrows._pack_window

    def marked(*args):
        (tmp_path / f"worker-{os.getpid()}").touch()
        return work(*args)

    monkeypatch.setattr(packrows, "_pack_window", marked)  # inherited by the forked workers
    two = packrows.epoch_rows(s, t, (8, 40, 32), True, 5, 2, window=256, workers=2)
    assert len(list(tmp_path.glob("worker-*"))) == 2 and not (tmp_path / f"worker-{os.getpid()}").exists()
    assert len(one) == len(two) > 3000 // 8
    assert all(np.array_equal(a, b) for a, b in zip(one, two))
    sampler = PackSampler(c.src_lengths, c.tgt_lengths, (8, 40, 32), shuffle=True, seed=5, window=256,
                          background=False)
    if _cpus() > 1 and threading.active_count() == 1:  # (an earlier test may leave a thread)
        assert sampler._plan_workers() > 1
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert sampler._plan_workers() == 1
    finally:
        stop.set()
        other.join()


def test_a_packing_process_that_dies_leaves_the_plan_to_this_one(monkeypatch):
    """A worker killed mid-plan (out of memory, SIGKILL) does not hang the plan: the windows are
    packed here instead, with the same rows."""
    from streamnmt.data import packrows

    c = random_corpus(2000, seed=6)
    s, t = c.src_lengths + 1, c.tgt_lengths + 1
    want = packrows.epoch_rows(s, t, (8, 40, 32), True, 3, 0, window=256)
    parent, work = os.getpid(), packrows._pack_window
    monkeypatch.setattr(packrows, "_pack_window", lambda *a: work(*a) if os.getpid() == parent else os._exit(9))
    got = packrows.epoch_rows(s, t, (8, 40, 32), True, 3, 0, window=256, workers=2)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_rows_hold_whole_pairs_within_both_widths():
    c = random_corpus(500)
    s, t = c.src_lengths + 1, c.tgt_lengths + 1
    rows = pack_rows(s, t, np.random.default_rng(1).permutation(len(c)), 40, 32, window=128)
    placed = np.concatenate(rows)
    assert sorted(placed.tolist()) == list(range(len(c)))  # every pair once
    assert all(s[r].sum() <= 40 and t[r].sum() <= 32 for r in rows)
    assert t.sum() / (32 * len(rows)) > 0.85  # rows are mostly full


def test_collate_places_pairs_back_to_back_with_segments_and_positions():
    c = corpus_of([([10, 11], [20, 21, 22]), ([12], [23]), ([13, 14, 15], [24, 25])])
    s = PackSampler(c.src_lengths, c.tgt_lengths, (2, 8, 8), shuffle=False)
    (plan,) = s.plan(0)
    b = collate_packed(c, plan).to_batch()
    assert b.shape == (2, 8, 8) and b.packed
    row = int(plan.slots[plan.pairs.tolist().index(0)])
    order = plan.pairs[plan.slots == row].tolist()
    src, tgt_in, tgt_out = b.src[row].tolist(), b.tgt_in[row].tolist(), b.tgt_out[row].tolist()
    col_s = col_t = 0
    for k, p in enumerate(order, 1):
        st, tt = c[p]
        n, m = len(st), len(tt)
        assert src[col_s:col_s + n + 1] == [*st.tolist(), EOS]
        assert tgt_out[col_t:col_t + m + 1] == [*tt.tolist(), EOS]
        assert tgt_in[col_t:col_t + m + 1] == [BOS, *tt.tolist()]
        assert b.src_seg[row, col_s:col_s + n + 1].tolist() == [k] * (n + 1)
        assert b.tgt_pos[row, col_t:col_t + m + 1].tolist() == list(range(m + 1))
        assert b.src_pos[row, col_s:col_s + n + 1].tolist() == list(range(n + 1))
        col_s, col_t = col_s + n + 1, col_t + m + 1
    assert set(src[col_s:]) <= {PAD} and set(b.src_seg[row, col_s:].tolist()) <= {0}
    assert b.ntokens == int((b.tgt_out != PAD).sum()) == 3 + 1 + 2 + 3 == b.norm_tokens
    assert abs(float(b.norm) - 1 / 9) < 1e-7


def pairs_by_step(sampler: PackSampler, micro: int) -> list[list[int]]:
    """Pairs of each global step as this sampler serves them (``micro`` micro-batches a step)."""
    plan = sampler.plan(sampler.epoch)
    return [sorted(np.concatenate([p.pairs for p in plan[k:k + micro]]).tolist())
            for k in range(0, len(plan), micro)]


@pytest.mark.parametrize("world,accum", [(2, 1), (1, 2), (2, 2)])
def test_global_steps_are_the_same_pairs_for_any_split(world, accum):
    c = random_corpus(300, seed=2)
    shape = (3, 40, 32)
    one = PackSampler(c.src_lengths, c.tgt_lengths, (3 * world * accum, 40, 32), shuffle=True, seed=5)
    ranks = [PackSampler(c.src_lengths, c.tgt_lengths, shape, shuffle=True, seed=5, world=world, accum=accum,
                         rank=r) for r in range(world)]
    per_rank = [pairs_by_step(s, accum) for s in ranks]
    assert len({len(p) for p in per_rank}) == 1 and len({len(s) for s in ranks}) == 1  # same step count
    steps = [sorted(sum((p[i] for p in per_rank), [])) for i in range(len(per_rank[0]))]
    assert steps == pairs_by_step(one, 1)  # the same pairs in the same global steps
    flat = sum(steps, [])
    assert len(set(flat)) == len(flat)  # disjoint: each pair at most once per epoch
    # only the rows of a partial last global step wait for another epoch (at most 16 pairs a row)
    assert len(c) - 16 * (3 * world * accum - 1) <= len(flat) < len(c)
    for s in ranks:  # every micro-batch has the one shape; the normaliser counts the whole step
        for p in s.plan(0):
            assert p.shape == shape
            b = collate_packed(c, p)
            assert b.norm_tokens == int(c.tgt_lengths[p.group].sum()) + len(p.group)


def test_plan_depends_on_seed_and_epoch_only():
    c = random_corpus(200, seed=3)
    a = PackSampler(c.src_lengths, c.tgt_lengths, (2, 40, 32), shuffle=True, seed=1)
    b = PackSampler(c.src_lengths, c.tgt_lengths, (2, 40, 32), shuffle=True, seed=1)
    same = [p.pairs.tolist() for p in a.plan(0)]
    assert same == [p.pairs.tolist() for p in b.plan(0)]
    assert same != [p.pairs.tolist() for p in b.plan(1)]


def test_resume_mid_epoch_serves_the_rest(tmp_path):
    c = random_corpus(200, seed=4)
    cfg = DataConfig(max_len=32, max_tokens=96, pack=True)
    a = make_loader(c, cfg, train=True, seed=7, pin_memory=False)
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    rest = [x.tgt_out.clone() for x in it]
    b = make_loader(c, cfg, train=True, seed=7, pin_memory=False)
    b.load_state_dict(state)
    again = [x.tgt_out for x in b]
    assert len(rest) == len(again) > 0 and all((x == y).all() for x, y in zip(rest, again))
    other = make_loader(c, DataConfig(max_len=32, max_tokens=64, pack=True), train=True, seed=7, pin_memory=False)
    with pytest.raises(InputError, match="packs"):
        other.load_state_dict(state)


def test_shape_and_padding_share():
    c = random_corpus(2000, seed=6)
    cfg = DataConfig(max_len=32, max_tokens=512, pack=True)
    loader = make_loader(c, cfg, train=True, seed=0, pin_memory=False)
    (shape,) = loader.shapes()
    assert shape == pack_shape(c.src_lengths, c.tgt_lengths, max_len=32, max_tokens=512, batch_size=32,
                               pad_multiple=8)
    assert shape[0] == 512 // 32 and shape[2] == 32
    counted = loader.num_tokens()  # of the epoch about to be served
    real = padded = 0
    for b in loader:
        assert b.shape == shape
        real += b.ntokens
        padded += shape[0] * shape[2]
    assert real == counted["tgt_tokens"]
    assert abs(counted["tgt_fill"] - real / padded) < 1e-9
    assert real / padded > 0.9


def test_validation_stays_unpacked():
    c = random_corpus(50, seed=8)
    loader = make_loader(c, DataConfig(max_len=32, pack=True), train=False, seed=0, pin_memory=False)
    assert all(not b.packed for b in loader)


def test_state_of_one_rank_resumes_on_two_at_the_same_share():
    c = random_corpus(400, seed=9)
    one = PackSampler(c.src_lengths, c.tgt_lengths, (2, 40, 32), shuffle=True, seed=3)
    one.position = 10
    state = one.state_dict()
    two = PackSampler(c.src_lengths, c.tgt_lengths, (2, 40, 32), shuffle=True, seed=3, world=2, rank=1)
    two.load_state_dict(state)
    assert two.position == -(-10 * len(two) // len(one))
    with pytest.raises(InputError, match="another training corpus"):
        PackSampler(c.src_lengths[1:], c.tgt_lengths[1:], (2, 40, 32), shuffle=True).load_state_dict(state)


def _fills(c: TokenizedCorpus, shape: tuple[int, int, int]) -> tuple[float, float]:
    s, t = c.src_lengths + 1, c.tgt_lengths + 1
    rows = pack_rows(s, t, np.random.default_rng(0).permutation(len(c)), shape[1], shape[2])
    return s.sum() / (len(rows) * shape[1]), t.sum() / (len(rows) * shape[2])


def test_source_width_keeps_the_target_full_with_less_source_padding():
    """pack_shape's source width: among 1 to 1.25 x the token ratio, the one with the most real
    target tokens per unit of work that keeps >= 95 % of the target positions real. Source
    lengths twice the target's, varying pair by pair, as in an EN->ZH corpus."""
    from streamnmt.data import packshape

    rng = np.random.default_rng(3)
    pairs = []
    for _ in range(3000):
        m = int(rng.integers(2, 20))
        pairs.append((list(rng.integers(4, 50, max(1, int(m * rng.uniform(1.2, 2.8))))), list(rng.integers(4, 50, m))))
    c = corpus_of(pairs)
    shape = pack_shape(c.src_lengths, c.tgt_lengths, max_len=128, max_tokens=4096, batch_size=32, pad_multiple=8)
    ratio = (c.src_lengths.sum() + len(c)) / (c.tgt_lengths.sum() + len(c))
    widest = packshape.round_up(int(np.ceil(128 * ratio * max(packshape.SRC_SLACKS))), 8)
    assert shape[0] == 32 and shape[2] == 128 and shape[1] < widest
    src_fill, tgt_fill = _fills(c, shape)
    wide_src, wide_tgt = _fills(c, (32, widest, 128))
    assert tgt_fill >= packshape.MIN_TGT_FILL and src_fill > wide_src + 0.03
    work = lambda fill, width: fill * 128 / (packshape.SRC_COST * width + 128)  # noqa: E731
    assert work(tgt_fill, shape[1]) > work(wide_tgt, widest)  # more real target tokens per unit of work


def test_a_checkpoint_of_another_source_width_resumes_with_its_own():
    """A state saved under an earlier source-width rule (same rows and target width) resumes with the
    saved width and serves exactly the rest of the saved plan."""
    c = random_corpus(400, seed=8)
    old = PackSampler(c.src_lengths, c.tgt_lengths, (4, 48, 32), shuffle=True, seed=5)
    it = iter(old)
    for _ in range(3):
        next(it)
        old.position += 1
    state = old.state_dict()
    rest = [p.pairs.tolist() for p in it]
    new = PackSampler(c.src_lengths, c.tgt_lengths, (4, 40, 32), shuffle=True, seed=5)
    new.load_state_dict(state)
    assert new.shape == (4, 48, 32) and [p.pairs.tolist() for p in new] == rest
    other = PackSampler(c.src_lengths, c.tgt_lengths, (4, 40, 24), shuffle=True, seed=5)  # another target width
    with pytest.raises(InputError, match="shape"):
        other.load_state_dict(state)


def test_the_next_epoch_is_planned_in_the_background_with_the_same_rows(monkeypatch):
    """Planning epoch e asks the planner process for epoch e + 1; its rows are those planned here,
    and after the planner dies the epochs are planned here, the same rows again."""
    import multiprocessing

    from streamnmt.data import packing, packrows

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork start method here: epochs are planned when they start")
    rng = np.random.default_rng(5)
    src, tgt = rng.integers(1, 30, 3000), rng.integers(1, 30, 3000)
    shape = pack_shape(src, tgt, max_len=32, max_tokens=512, batch_size=0, pad_multiple=8)
    monkeypatch.setattr(packing, "_ROWS_CACHE", {})
    monkeypatch.setattr(packrows, "_PLANNER", None)
    s = PackSampler(src, tgt, shape, shuffle=True, seed=11)
    planner = packrows._PLANNER
    assert planner and planner._proc.is_alive()  # forked with the sampler
    s.plan(0)
    assert planner._asked == [s._key(1)]  # epoch 1 under way
    want = packrows.epoch_rows(s.src_len, s.tgt_len, shape, True, 11, 1, packrows.WINDOW)
    got = s._rows(1)
    assert not planner._asked and len(got) == len(want) > 10
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    # Ctrl-C reaches the whole process group: the trainer saves and stops, the planner lives on
    import signal
    import time

    os.kill(planner._proc.pid, signal.SIGINT)
    time.sleep(0.3)
    assert planner._proc.is_alive()
    # the planner killed before it answers: epoch 2 is planned here, and later epochs too
    s._plan_ahead(2)
    planner._proc.kill()
    planner._proc.join()
    want2 = packrows.epoch_rows(s.src_len, s.tgt_len, shape, True, 11, 2, packrows.WINDOW)
    assert all(np.array_equal(a, b) for a, b in zip(s._rows(2), want2))
    assert packrows._PLANNER is False and packrows._planner() is None


def test_a_process_forked_from_one_with_a_planner_plans_through_its_own(monkeypatch):
    """Two processes forked at once from one with a planner never read its one pipe: each forks a
    planner of its own on first use, and its rows are those planned in place."""
    import multiprocessing

    from streamnmt.data import packrows

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork start method here")
    monkeypatch.setattr(packrows, "_PLANNER", None)
    parents = packrows._planner()
    assert parents and parents._proc.is_alive()
    rng = np.random.default_rng(3)
    src, tgt = rng.integers(1, 30, 2000), rng.integers(1, 30, 2000)
    shape = pack_shape(src, tgt, max_len=32, max_tokens=512, batch_size=0, pad_multiple=8)

    def child(seed: int) -> int:
        if packrows._PLANNER is not None:
            return 3  # the parent's planner, and its pipe, inherited
        own = packrows._planner()
        if not own or own._proc.pid == parents._proc.pid:
            return 4
        key = ("forked", seed)
        own.submit(key, (src, tgt, shape, True, seed, 1, packrows.WINDOW))
        want = packrows.epoch_rows(src, tgt, shape, True, seed, 1, packrows.WINDOW)
        got = own.result(key)
        return 0 if len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)) else 5

    pids = []
    for seed in (1, 2):
        pid = os.fork()
        if pid == 0:
            code = 6
            try:
                code = child(seed)
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert codes == [0, 0]
    assert packrows._PLANNER is parents and parents._proc.is_alive() and not parents._asked


def test_the_planner_ends_on_sigterm_even_when_forked_under_the_trainers_handler(monkeypatch):
    """multiprocessing ends its daemon children with SIGTERM at exit and joins them: a planner forked
    while the trainer's stop handler (which only sets a flag) was installed must still end, or the
    trainer's (or the test session's) exit waits for it forever."""
    import multiprocessing
    import signal

    from streamnmt.data import packrows

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork start method here")
    for _ in range(5):  # SIGTERM at once after the fork, too: before the child's own handlers are set
        monkeypatch.setattr(packrows, "_PLANNER", None)
        old = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as stop_signals' request_stop
        try:
            planner = packrows._planner()
        finally:
            signal.signal(signal.SIGTERM, old)
        assert planner
        planner._proc.terminate()
        planner._proc.join(10)
        alive = planner._proc.is_alive()
        if alive:
            planner._proc.kill()
            planner._proc.join()
        monkeypatch.setattr(packrows, "_PLANNER", None)
        assert not alive and planner._proc.exitcode == -signal.SIGTERM


def test_a_resumed_epoch_planned_ahead_reaches_the_loaders_sampler_and_shapes_need_no_plan(monkeypatch):
    """A resume asks the planner for its epoch before the model is built: another sampler of the same
    corpus, shape and seed takes those rows from it, and the batch shapes come without planning."""
    import multiprocessing

    from streamnmt.data import (
        DataConfig,
        batch_plan,
        batch_shapes,
        make_sampler,
        packing,
        packrows,
    )

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork start method here: epochs are planned when they start")
    corpus = random_corpus(2000, seed=3, longest=20)
    cfg = DataConfig(max_tokens=256, max_len=32)
    monkeypatch.setattr(packing, "_ROWS_CACHE", {})
    monkeypatch.setattr(packrows, "_PLANNER", None)
    early = make_sampler(corpus, cfg, train=True, seed=7)
    early.plan_ahead(3)
    planner = packrows._PLANNER
    assert planner and planner._asked == [early._key(3)]
    want = packrows.epoch_rows(early.src_len, early.tgt_len, early.shape, True, 7, 3, packrows.WINDOW)

    def no_planning_here(*args, **kwargs):
        raise AssertionError("planned in the trainer's process")

    monkeypatch.setattr(packing, "epoch_rows", no_planning_here)
    assert batch_shapes(corpus, cfg) == [early.shape]  # no epoch planned for the shapes
    with pytest.raises(AssertionError, match="planned in the trainer's process"):
        batch_plan(corpus, cfg)  # the count does plan one (epoch 0 of seed 0)
    loader_sampler = make_sampler(corpus, cfg, train=True, seed=7)
    got = loader_sampler._rows(3)  # from the planner
    assert [r.tolist() for r in got] == [r.tolist() for r in want]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux: a fork planner and /proc")
def test_the_planner_ends_when_its_trainer_is_killed(tmp_path):
    """A trainer killed by SIGKILL leaves no planner behind (it would hold the trainer's output
    pipes open, and a caller waiting for them would wait forever)."""
    import subprocess
    import sys
    import time

    code = ("import numpy as np, os, sys; from streamnmt.data.packing import PackSampler; "
            "from streamnmt.data.packshape import pack_shape; "
            "rng = np.random.default_rng(0); s, t = rng.integers(1, 30, 500), rng.integers(1, 30, 500); "
            "p = PackSampler(s, t, pack_shape(s, t, max_len=32, max_tokens=256, batch_size=0, pad_multiple=8), "
            "shuffle=True); from streamnmt.data import packrows; print(packrows._PLANNER._proc.pid, flush=True); "
            "os.kill(os.getpid(), 9)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr[-500:]
    pid = int(proc.stdout.split()[0])
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:  # a zombie (not yet reaped by init) has ended too
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (ProcessLookupError, FileNotFoundError):
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    raise AssertionError("the planner outlived its trainer")
