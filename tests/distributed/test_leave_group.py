"""Leaving a tensor-parallel group never hangs the process: NCCL's graceful destroy waits for every rank,
so ``leave_group`` bounds it and says whether it finished."""

from __future__ import annotations

import threading

import torch.distributed as dist

from g4serve.engine import tensor_parallel


def test_a_destroy_that_never_returns_is_given_up_after_the_timeout(monkeypatch, caplog):
    release = threading.Event()
    called = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (called.append("destroy"), release.wait(30)))
    try:
        assert tensor_parallel.leave_group(together=True, timeout_s=0.2) is False
    finally:
        release.set()
    assert called == ["destroy"]
    assert "not destroyed within" in caplog.text


def test_without_the_other_ranks_the_communicators_are_aborted(monkeypatch):
    called = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: called.append("destroy"))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda: called.append("abort"))
    assert tensor_parallel.leave_group(together=False, timeout_s=5.0) is True
    assert called == ["abort"]
    assert tensor_parallel.leave_group(together=True, timeout_s=5.0) is True
    assert called == ["abort", "destroy"]


def test_no_group_no_call(monkeypatch):
    called = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: called.append("destroy"))
    assert tensor_parallel.leave_group(together=True, timeout_s=1.0) is True
    assert called == []
