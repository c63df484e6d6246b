"""The test hooks: off unless their variable is set, and read where the tests set them."""

from __future__ import annotations

from streamnmt import testhooks


def test_hooks_are_off_without_their_variables(monkeypatch):
    for name in (testhooks.KILL_AT_STEP, testhooks.INF_LOSS_CALL, testhooks.INF_GRAD_FROM_CALL,
                 testhooks.CAPTURE_FAIL_RANK):
        monkeypatch.delenv(name, raising=False)
    assert (testhooks.kill_at_step(), testhooks.inf_loss_call(), testhooks.inf_grad_from_call()) == (0, 0, 0)
    assert testhooks.capture_failure() is None


def test_hooks_read_their_variables_and_the_capture_fails_on_the_named_rank_only(monkeypatch):
    monkeypatch.setenv("STREAMNMT_TEST_KILL_AT_STEP", "35")
    monkeypatch.setenv("STREAMNMT_INJECT_INF_STEP", "7")
    monkeypatch.setenv("STREAMNMT_INJECT_INF_GRAD_FROM", "3")
    assert (testhooks.kill_at_step(), testhooks.inf_loss_call(), testhooks.inf_grad_from_call()) == (35, 7, 3)
    monkeypatch.setenv("STREAMNMT_TEST_CAPTURE_FAIL_RANK", "1")
    monkeypatch.setenv("RANK", "0")
    assert testhooks.capture_failure() is None
    monkeypatch.setenv("RANK", "1")
    assert "STREAMNMT_TEST_CAPTURE_FAIL_RANK" in testhooks.capture_failure()
