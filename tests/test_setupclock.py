"""The set-up line names what dominated a part of the set-up (the largest thing timed in it)."""

from __future__ import annotations

import os
import types

import pytest
import torch

from streamnmt import setupclock


@pytest.fixture
def clock(monkeypatch):
    """A host clock that moves only when told: now[0] seconds."""
    now = [100.0]
    monkeypatch.setattr(setupclock.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(setupclock, "_OPEN", [])
    monkeypatch.setattr(setupclock, "_BY_PART", {})
    return now


def spend(clock, what, seconds):
    with setupclock.timed(what):
        clock[0] += seconds


def test_each_part_names_the_largest_thing_timed_in_it(clock):
    spend(clock, "waiting for the kernels", 0.05)  # too short to name
    setupclock.close("device")
    spend(clock, "waiting for the kernels", 0.4)
    spend(clock, "Triton kernel build check", 7.5)
    setupclock.close("recipe")
    setupclock.close("data")
    assert setupclock.detail("device") == "" and setupclock.detail("data") == ""
    assert setupclock.detail("recipe") == " (Triton kernel build check 7.5 s)"
    assert setupclock.detail("model") == ""


def test_a_failure_inside_is_timed_too(clock):
    with pytest.raises(RuntimeError), setupclock.timed("Triton kernel build check"):
        clock[0] += 2.0
        raise RuntimeError("no ptxas")
    setupclock.close("recipe")
    assert setupclock.detail("recipe") == " (Triton kernel build check 2.0 s)"


def test_the_set_up_line_says_it(clock):
    from streamnmt.training.build import setup_line

    spend(clock, "Triton kernel build check", 7.5)
    setupclock.close("recipe")
    run = types.SimpleNamespace(setup_s={"start-up": 5.0, "recipe": 7.9, "data": 0.8},
                                device=torch.device("cpu"), strategy=None,
                                job=types.SimpleNamespace(engine=types.SimpleNamespace(compile="off")))
    assert setup_line(run) == ("set-up 13.7 s: start-up (interpreter and imports) 5.0 s, recipe 7.9 s "
                                   "(Triton kernel build check 7.5 s), data 0.8 s")


def test_usable_cores_are_this_processs_affinity_else_all(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert setupclock.usable_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    assert setupclock.usable_cores() == 7
