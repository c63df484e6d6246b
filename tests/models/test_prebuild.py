"""The Triton kernels' build in a child process: when one is started, what the build check waits for,
and the one line where the child failed or was late (a fake child on the CPU; the real one on a GPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamnmt import setupclock
from streamnmt.config import build_job
from streamnmt.models import attention, prebuild
from streamnmt.models.prebuild import Request


class FakeChild:
    """Stands in for the child process: exits with ``code`` (None: still running at the timeout)."""

    def __init__(self, argv, code=0, last="", started=None):
        self.argv, self.code, self.last, self.timeouts, self.stopped = list(argv), code, last, [], False
        if started is not None:
            started.append(self)

    def wait(self, timeout):
        self.timeouts.append(timeout)
        if self.code is None:
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return self.code

    def stop(self):
        self.stopped = True

    def last_line(self):
        return self.last


@pytest.fixture(autouse=True)
def _no_child_left(monkeypatch):
    """No child left running; a small machine's cores (MIN_CHILDREN children: one a variant) unless a
    test gives its own."""
    monkeypatch.setattr(setupclock, "usable_cores", lambda: 2)
    prebuild.stop()
    yield
    prebuild.stop()


def plan_of(cuda=True, triton=True, hip=False, device=None, **flags):
    job = build_job(flags)
    job.run.device = device  # as given on a GPU machine (this one may have none to validate it against)
    return prebuild.plan(job, cuda=cuda, triton=triton, hip=hip)


def test_the_child_builds_what_the_build_check_will_build():
    assert plan_of() == Request(0, 64, "auto")  # auto: the base preset on a GPU, 512 / 8 heads
    assert plan_of(model="big", device="cuda:1", amp="fp16") == Request(1, 64, "fp16")
    assert plan_of(model="tiny", attention="triton") == Request(0, 16, "auto")
    assert plan_of(d_model=256, n_heads=2, attention="triton") == Request(0, 128, "auto")
    assert plan_of(attention="triton", attention_dropout=0.1) == Request(0, 64, "auto")  # asked for: checked
    for why_not in (dict(cuda=False), dict(triton=False), dict(hip=True), dict(device="cpu"),
                    dict(attention="sdpa"), dict(attention="flex"), dict(attention_dropout=0.1),  # auto: sdpa
                    dict(d_model=480, n_heads=10), dict(d_model=1024, n_heads=4)):  # head dims 48, 256 (auto)
        assert plan_of(**why_not) is None, why_not


def test_start_for_starts_a_child_only_with_cuda_and_on_a_hosts_first_process(monkeypatch):
    started: list[FakeChild] = []
    launch = lambda argv: FakeChild(argv, started=started)  # noqa: E731
    job = build_job({})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prebuild.start_for(job, launch) is None and started == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert prebuild.start_for(job, launch) is None and started == []
    monkeypatch.setenv("LOCAL_RANK", "0")
    if prebuild.plan(job, cuda=True, triton=True, hip=False) is None or attention.triton_available(
            torch.device("cuda", 0)) == "Triton is not installed":
        pytest.skip("Triton is not installed")
    assert prebuild.start_for(job, launch) == Request(0, 64, "auto")
    assert [c.argv[-4:-1] for c in started] == [["0", "64", "auto"]] * prebuild.MIN_CHILDREN
    assert [c.argv[-1] for c in started] == [",".join(g) for g in prebuild.group(prebuild.jobs_for(Request(0, 64, "auto")), 2)]
    assert all(c.argv[0] == sys.executable and "build_in_child" in c.argv[2] for c in started)


def test_the_check_waits_once_for_the_children_that_built_the_kernels_then_marks_them():
    started: list[FakeChild] = []
    marked: list[Request] = []
    prebuild.start(Request(0, 64, "auto"), lambda argv: FakeChild(argv, started=started))
    assert prebuild.wait(0, 32) is None and prebuild.wait(1, 64) is None  # another build: not waited for
    assert prebuild.pending(0, 64) and not prebuild.pending(0, 32)
    assert [c.timeouts for c in started] == [[], [], []]
    assert prebuild.wait(0, 64, timeout=7.0, mark=marked.append) is None
    assert all(len(c.timeouts) == 1 and 6.0 < c.timeouts[0] <= 7.0 for c in started)  # one deadline for all
    assert marked == [Request(0, 64, "auto")] and not prebuild.pending(0, 64)
    assert prebuild.wait(0, 64, mark=marked.append) is None and len(marked) == 1  # forgotten after


def test_a_child_that_failed_or_was_late_leaves_the_build_here_in_one_line():
    marked: list[Request] = []
    started: list[FakeChild] = []
    codes = iter([0, 1, 0])
    prebuild.start(Request(0, 64, "auto"),
                   lambda argv: FakeChild(argv, code=next(codes), last="RuntimeError: no ptxas", started=started))
    line = prebuild.wait(0, 64, mark=marked.append)
    assert line.startswith("the Triton kernels' build in a child process failed (exit 1: RuntimeError: no ptxas")
    assert line.endswith("building them here") and "\n" not in line
    assert marked == [] and all(c.stopped for c in started)  # no marker; none left compiling
    started.clear()
    prebuild.start(Request(0, 64, "auto"), lambda argv: FakeChild(argv, code=None, started=started))
    assert prebuild.wait(0, 64, timeout=2.0, mark=marked.append) == (
        "the Triton kernels' build in a child process did not finish in 2 s; building them here")
    assert marked == [] and all(c.stopped for c in started)  # killed, not left compiling beside the run


def test_the_build_check_waits_for_the_child_then_builds_and_says_why(monkeypatch):
    """triton_runs: the child first (one line where it failed), then the build check itself, which
    finds the child's kernels in Triton's cache or builds them."""
    events: list[str] = []
    monkeypatch.setattr(attention, "triton_available", lambda device, head_dim=None: None)
    monkeypatch.setattr(attention, "_triton_builds", lambda index, head_dim: events.append(f"build {head_dim}"))
    monkeypatch.setattr(prebuild, "wait", lambda index, head_dim: events.append(f"wait {index} {head_dim}") or
                        "the Triton kernels' build in a child process failed (exit 1); building them here")
    lines: list[str] = []
    assert attention.triton_runs(torch.device("cuda", 2), 64, lines.append) is None
    assert events == ["wait 2 64", "build 64"]
    assert lines == ["model: the Triton kernels' build in a child process failed (exit 1); building them here"]


def test_one_process_trusts_running_children_until_the_step_needs_the_kernels(monkeypatch):
    """Without torchrun the build check owes the wait while children compile (the set-up's data and
    model phases run beside them); settle_triton waits and checks once; under torchrun it waits at once."""
    events: list[str] = []
    monkeypatch.setattr(attention, "triton_available", lambda device, head_dim=None: None)
    monkeypatch.setattr(attention, "_triton_builds",
                        lambda index, head_dim: events.append(f"build {head_dim}") or ("no ptxas" if head_dim == 32 else None))
    monkeypatch.setattr(prebuild, "wait", lambda index, head_dim: events.append(f"wait {index} {head_dim}"))
    monkeypatch.setattr(attention, "_OWED", {})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prebuild.start(Request(0, 64, "auto"), FakeChild)
    assert attention.triton_runs(torch.device("cuda", 0), 64) is None and events == []  # trusted, owed
    assert attention.triton_runs(torch.device("cuda", 0), 64) is None and events == []  # asked again: still owed
    assert attention.settle_triton() is None and events == ["wait 0 64", "build 64"]
    assert attention.settle_triton() is None and len(events) == 2  # settled once
    prebuild.start(Request(0, 32, "auto"), FakeChild)
    attention.triton_runs(torch.device("cuda", 0), 32)
    assert attention.settle_triton() == "no ptxas"  # the caller trains with sdpa and says so
    events.clear()
    monkeypatch.setenv("WORLD_SIZE", "2")
    prebuild.start(Request(0, 64, "auto"), FakeChild)
    assert attention.triton_runs(torch.device("cuda", 0), 64) is None and events == ["wait 0 64", "build 64"]
    assert attention.settle_triton() is None and len(events) == 2


def test_the_child_process_runs_its_command_and_its_last_line_is_read():
    child = prebuild.Child([sys.executable, "-c", "import sys; print('compiling'); print('RuntimeError: no ptxas', "
                                                  "file=sys.stderr); sys.exit(3)"])
    assert child.wait(30) == 3 and child.last_line() == "RuntimeError: no ptxas"
    sleeper = prebuild.Child([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.1)
    sleeper.stop()
    assert sleeper.process.poll() is not None


def test_train_starts_the_child_from_its_job_and_from_a_checkpoints(monkeypatch, tmp_path):
    from streamnmt import cli

    jobs = []
    monkeypatch.setattr(prebuild, "start_for", jobs.append)
    job = build_job({"model": "tiny"})
    cli._prebuild_kernels(job, None, None)
    torch.save({"config": build_job({"model": "small", "device": "cpu"}).to_dict()}, tmp_path / "last.pt")
    cli._prebuild_kernels(None, str(tmp_path / "last.pt"), "cuda:1")
    cli._prebuild_kernels(None, str(tmp_path / "missing.pt"), None)  # the trainer says what is wrong
    assert [j.model.model for j in jobs] == ["tiny", "small"] and jobs[1].run.device == "cuda:1"


@pytest.mark.gpu
@pytest.mark.parametrize("amp, cores", [("auto", 64), ("fp16", 2)])
def test_a_child_fills_tritons_cache_with_the_build_checks_kernels(tmp_path, monkeypatch, amp, cores):
    """On a GPU: the children (one job each, or several jobs each on a small machine) build the
    kernels into a fresh Triton cache, and this process's build check (and the training dtype's
    under ``--amp fp16``) then compiles nothing more (no new file in the cache): each job's launch
    is specialised as the check's call is."""
    if not torch.cuda.is_available() or attention.triton_available(torch.device("cuda")) is not None:
        pytest.skip("needs CUDA and Triton (run on the GPU machine: pytest -m gpu)")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    index = torch.cuda.current_device()
    prebuild.start(Request(index, 64, amp), cores=cores)
    assert prebuild.wait(index, 64) is None
    files = sorted(tmp_path.rglob("*"))
    assert any(p.suffix == ".cubin" for p in files), files
    assert prebuild.marker(Request(index, 64, amp), prebuild.gpu_of(index)) in files  # the next run starts none
    # the check in a fresh process: this one may hold the kernels in memory from an earlier test
    code = (f"import torch; from streamnmt.models import attention as a; d = torch.device('cuda', {index}); "
            f"a.triton_probe(d, a._check_dtype({index}), 64); "
            f"{'a.triton_probe(d, torch.float16, 64)' if amp == 'fp16' else ''}")
    check = prebuild.Child([sys.executable, "-c", code])
    assert check.wait(300) == 0, check.last_line()
    check.stop()
    assert sorted(tmp_path.rglob("*")) == files


def test_the_marker_lives_in_tritons_cache_and_names_what_the_kernels_depend_on(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    req = Request(0, 64, "auto")
    path = prebuild.marker(req, "GPU sm90")
    assert path.parent == tmp_path / "cache" and path == prebuild.marker(Request(1, 64, "auto"), "GPU sm90")
    others = {prebuild.marker(Request(0, 32, "auto"), "GPU sm90"), prebuild.marker(Request(0, 64, "fp16"), "GPU sm90"),
              prebuild.marker(req, "GPU sm80")}
    assert path not in others and len(others) == 3
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    assert prebuild.marker(req, "GPU sm90").parent == tmp_path / "home" / ".triton" / "cache"


def test_mark_built_writes_whole_and_never_fails_the_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    req = Request(0, 64, "auto")
    prebuild.mark_built(req, "GPU sm90")
    assert prebuild.marker(req, "GPU sm90").read_text().startswith("GPU sm90")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [prebuild.marker(req, "GPU sm90").name]
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "file" / "cache"))  # cannot be made: no marker, no error
    prebuild.mark_built(req, "GPU sm90")


def test_a_build_marked_in_the_cache_starts_no_child(tmp_path, monkeypatch):
    import importlib.util

    started: list[FakeChild] = []
    launch = lambda argv: FakeChild(argv, started=started)  # noqa: E731
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(prebuild, "gpu_of", lambda index: f"GPU{index} sm90")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    job = build_job({})
    n = prebuild.MIN_CHILDREN
    assert prebuild.start_for(job, launch) == Request(0, 64, "auto") and len(started) == n
    prebuild.stop()
    prebuild.mark_built(Request(0, 32, "auto"), "GPU0 sm90")  # another head dim's kernels: still children
    assert prebuild.start_for(job, launch) == Request(0, 64, "auto") and len(started) == 2 * n
    prebuild.stop()
    prebuild.mark_built(Request(0, 64, "auto"), "GPU0 sm90")
    assert prebuild.start_for(job, launch) is None and len(started) == 2 * n
    assert prebuild.wait(0, 64) is None  # the build check then builds (loads) them itself
    monkeypatch.setattr(prebuild, "gpu_of", lambda index: (_ for _ in ()).throw(RuntimeError("no GPU")))
    assert prebuild.start_for(job, launch) == Request(0, 64, "auto") and len(started) == 3 * n  # unsure: children


def test_the_build_check_reads_the_cache_the_children_filled_though_the_run_moved_it(tmp_path, monkeypatch):
    """A compiling run points TRITON_CACHE_DIR at its compile cache after the children started: the
    check loads their kernels from their folder (then the variable is as the run set it), and the
    marker goes where the next run's children would look."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "children"))
    monkeypatch.setattr(prebuild, "gpu_of", lambda index: "GPU sm90")
    seen: list[str] = []
    monkeypatch.setattr(attention, "_triton_builds", lambda index, head_dim: seen.append(os.environ["TRITON_CACHE_DIR"]))
    monkeypatch.setattr(attention, "_OWED", {})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(attention, "triton_available", lambda device, head_dim=None: None)
    prebuild.start(Request(0, 64, "auto"), FakeChild)
    assert attention.triton_runs(torch.device("cuda", 0), 64) is None
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "compile"))  # the compile cache, staged later
    assert attention.settle_triton() is None
    assert seen == [str(tmp_path / "children")]
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "compile")
    assert prebuild.marker(Request(0, 64, "auto"), "GPU sm90", tmp_path / "children").exists()
    monkeypatch.delenv("TRITON_CACHE_DIR")
    with prebuild.triton_cache(tmp_path / "x"):
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "x")
    assert "TRITON_CACHE_DIR" not in os.environ


def test_no_children_on_a_gpu_in_exclusive_process_mode(monkeypatch):
    """Under Exclusive Process a child's CUDA context would keep the run's own off the GPU."""
    import types

    mode = {"m": 3}
    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None, NVML_COMPUTEMODE_DEFAULT=0,
                                 nvmlDeviceGetHandleByIndex=lambda i: i,
                                 nvmlDeviceGetComputeMode=lambda h: mode["m"])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert prebuild._shared_gpu(0) is False
    mode["m"] = 0
    assert prebuild._shared_gpu(0) is True
    monkeypatch.setattr(fake, "nvmlInit", lambda: (_ for _ in ()).throw(RuntimeError("no driver")))
    assert prebuild._shared_gpu(0) is True  # not known: children as before


def test_a_stopped_child_closes_its_output():
    child = prebuild.Child([sys.executable, "-c", "print('x')"])
    child.wait(30)
    child.stop()
    assert child.output.closed and child.last_line() == ""


def test_the_jobs_are_every_variants_kernels_and_the_training_dtypes_too():
    """Forward, dk/dv and dq of each variant (the variant-free delta once), parsed as the child parses
    them; the training dtype's again where --amp names one other than the check's bf16."""
    jobs = prebuild.jobs_for(Request(0, 64, "auto"))
    parsed = attention.parse_jobs(",".join(jobs))
    assert sorted((v, k) for v, k, _ in parsed) == sorted(
        [(v, (k,)) for v in prebuild.VARIANTS for k in ("fwd", "dq")]
        + [(0, ("delta", "dkdv")), (1, ("dkdv",)), (2, ("dkdv",))])
    assert {amp for _, _, amp in parsed} == {None}
    assert prebuild.jobs_for(Request(0, 64, "bf16")) == jobs
    for amp in ("fp16", "off"):
        assert prebuild.jobs_for(Request(0, 64, amp)) == jobs + [f"{j}:{amp}" for j in jobs]
    for bad in ("3:fwd", "0:bwd", "0", "0:fwd:fp8", "x:fwd"):
        with pytest.raises(ValueError, match="Triton build job"):
            attention.parse_jobs(bad)


def test_the_jobs_are_grouped_by_the_cores_left_to_them():
    """One job a child where the cores allow (all but LEFT_CORES: this process and the tokenizers'
    child), else fewer children with several, never fewer than MIN_CHILDREN; each job once."""
    from streamnmt.setupclock import LEFT_CORES

    for amp in ("auto", "off"):
        jobs = prebuild.jobs_for(Request(0, 64, amp))
        for cores in range(1, LEFT_CORES + len(jobs) + 3):
            groups = prebuild.group(jobs, cores)
            assert len(groups) == min(len(jobs), max(prebuild.MIN_CHILDREN, cores - LEFT_CORES)), (amp, cores)
            assert sorted(j for g in groups for j in g) == sorted(jobs)
            assert max(map(len, groups)) - min(map(len, groups)) <= 1
    jobs = prebuild.jobs_for(Request(0, 64, "auto"))
    assert prebuild.group(jobs, 64) == [[j] for j in jobs]
    assert [{j.split(":")[0] for j in g} for g in prebuild.group(jobs, 2)] == [{"0"}, {"1"}, {"2"}]  # one a variant
    started: list[FakeChild] = []
    prebuild.start(Request(0, 64, "auto"), lambda argv: FakeChild(argv, started=started), cores=LEFT_CORES + 5)
    assert [c.argv[-1] for c in started] == [",".join(g) for g in prebuild.group(jobs, LEFT_CORES + 5)]
    assert len(started) == 5


def test_build_in_child_runs_only_its_jobs_launches(monkeypatch):
    """A job list: each job's kernels of its variant, in the check's dtype or its --amp's (none where
    that is the check's); no list: the whole build check, and the training dtype's."""
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention, "_check_dtype", lambda index: torch.bfloat16)
    monkeypatch.setattr(attention, "probe_kernels", lambda device, dtype, head_dim, variant, kernels:
                        calls.append((str(device), dtype, head_dim, variant, kernels)))
    monkeypatch.setattr(attention, "triton_probe", lambda device, dtype, head_dim, variants=(0, 1, 2):
                        calls.append((str(device), dtype, head_dim, variants)))
    assert attention.build_in_child(["1", "64", "fp16", "0:fwd,2:delta+dkdv:fp16,1:dq:bf16"]) == 0
    assert calls == [("cuda:1", torch.bfloat16, 64, 0, ("fwd",)), ("cuda:1", torch.float16, 64, 2, ("delta", "dkdv"))]
    calls.clear()
    assert attention.build_in_child(["0", "32", "off"]) == 0
    assert calls == [("cuda:0", torch.bfloat16, 32, (0, 1, 2)), ("cuda:0", torch.float32, 32, (0, 1, 2))]
    calls.clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert attention.build_in_child(["0", "64", "auto", "0:fwd"]) == 0 and calls == []  # auto picks sdpa there


class Launches:
    """Stands in for the Triton kernels: records each launch as Triton's cache key sees it (the
    kernel, its arguments' dtypes, 16-byte alignment, ints equal to 1 or divisible by 16 where
    specialised on, constexprs and launch options), runs nothing."""

    def __init__(self, monkeypatch):
        from streamnmt.models import segattn_triton as st

        self.calls: list[tuple] = []
        for name in ("_fwd", "_delta", "_bwd_dkdv", "_bwd_dq"):
            monkeypatch.setattr(st, name, self._kernel(name, getattr(st, name), st._SHAPE_ARGS))

    def _kernel(self, name, fn, unspecialised):
        calls = self.calls

        def key(arg_name, x):
            if isinstance(x, torch.Tensor):
                return arg_name, str(x.dtype), x.data_ptr() % 16 == 0
            if isinstance(x, bool):
                return arg_name, x
            if isinstance(x, int):
                return (arg_name, "int32" if -2**31 <= x < 2**31 else "int64",
                        None if arg_name in unspecialised else (x == 1, x % 16 == 0))
            return arg_name, type(x).__name__

        class Kernel:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    calls.append((name, tuple(key(n, x) for n, x in zip(fn.arg_names, args)),
                                  tuple(sorted(kwargs.items()))))
                return run

        return Kernel()


def test_every_kernel_of_the_build_check_is_one_jobs_launch_specialised_alike(monkeypatch):
    """The launches of the jobs, run alone, are the build check's launches (forward and backward,
    each variant, the check's dtype and the training's): the same cache keys, each built by exactly
    one job (the delta kernel, the same for every variant, by one)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    launches = Launches(monkeypatch)
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float16):
        attention.triton_probe(cpu, dtype, 64)
    probe = set(launches.calls)
    launches.calls.clear()
    for variant, kernels, amp in attention.parse_jobs(",".join(prebuild.jobs_for(Request(0, 64, "fp16")))):
        attention.probe_kernels(cpu, torch.bfloat16 if amp is None else torch.float16, 64, variant, kernels)
    assert set(launches.calls) == probe and len(launches.calls) == len(probe)  # each once: no two jobs compile one
    assert len(probe) == 2 * (3 * 3 + 1)


def test_backward_launches_delta_then_dkdv_then_dq_on_its_tensors(monkeypatch):
    """_backward calls the launch helpers in the kernels' order, dk/dv and dq reading the delta the
    delta kernel wrote."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    from streamnmt.models import segattn_triton as st
    from streamnmt.models.segments import segment_ranges

    calls: list[tuple[str, tuple]] = []
    for name in ("_launch_delta", "_launch_dkdv", "_launch_dq"):
        monkeypatch.setattr(st, name, lambda *args, _name=name: calls.append((_name, args)))
    q = torch.randn(1, 2, 32, 16)
    seg = torch.ones(1, 32, dtype=torch.int32)
    r = segment_ranges(seg, seg, causal=True, cross=False)
    lse = torch.zeros(1, 2, 32)
    dq, dk, dv = st._backward(q, q, q, q, q, lse, r.q_seg, r.k_seg, r.lo, r.hi, r.qlo, r.qhi, r.elo, r.ehi, True, False)
    assert [n for n, _ in calls] == ["_launch_delta", "_launch_dkdv", "_launch_dq"]
    delta = calls[0][1][2]
    assert calls[1][1][7] is delta and calls[2][1][6] is delta and calls[1][1][6] is lse
    assert calls[1][1][4:6] == (dk, dv) and calls[2][1][4] is dq and calls[1][1][-2:] == (True, False)


def _run_jobs_interpreted() -> None:
    """In a child under Triton's interpreter: every job of a build with a second dtype, alone."""
    for job in prebuild.jobs_for(Request(0, 16, "fp16")):
        for variant, kernels, amp in attention.parse_jobs(job):
            attention.probe_kernels(torch.device("cpu"), torch.float32 if amp is None else torch.float16, 16,
                                    variant, kernels)
        print(f"job {job}: ok", flush=True)


def test_each_jobs_launches_run_alone_under_the_interpreter():
    """The kernels launched alone, on the build check's input, run (no fault, the arguments each
    kernel takes) in Triton's interpreter on the CPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", "import tests.models.test_prebuild as t; t._run_jobs_interpreted()"],
                          cwd=root, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [f"job {j}: ok" for j in prebuild.jobs_for(Request(0, 16, "fp16"))]
