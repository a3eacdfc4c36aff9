"""The trainer's process-group teardown (:func:`sftprof.trainer.destroy_process_groups`), in one CPU process on gloo.

After the closing barrier every group is shut down at once, each in a thread of its own (torch's
``destroy_process_group`` shuts NCCL groups down one after another, ~0.48 s each on a GPU); a failed trial's
teardown is torch's own. Concurrency is checked without a clock: each group's shutdown waits on one
``threading.Barrier`` for all of them, which only a parallel shutdown can pass.
"""
import logging
import threading

import pytest
import torch.distributed as dist

from sftprof.trainer import destroy_process_groups, init_distributed

GROUPS = 5  # subgroups made beside the default one


@pytest.fixture
def gloo_groups(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    init_distributed()
    groups = [dist.new_group([0]) for _ in range(GROUPS)]
    yield [dist.GroupMember.WORLD] + groups
    if dist.is_initialized():
        dist.destroy_process_group()


def _recording_shutdown(monkeypatch, parties: int | None, fail: bool = False):
    """Replace ``ProcessGroup.shutdown``: record each call's group; with ``parties``, a group's first call first waits
    on a barrier of that many (10 s: a sequential shutdown breaks it instead of hanging the test; the calls
    ``destroy_process_group`` makes afterwards pass straight through); ``fail``: a group's first call raises instead."""
    calls, barrier = [], threading.Barrier(parties, timeout=10) if parties else None
    real = dist.ProcessGroup.shutdown

    def shutdown(pg):
        first = all(pg is not seen for seen in calls)
        calls.append(pg)
        if first and fail:
            raise RuntimeError("shutdown refused")
        if barrier is not None and first:
            barrier.wait()
        real(pg)
    monkeypatch.setattr(dist.ProcessGroup, "shutdown", shutdown)
    return calls


def test_after_the_barrier_every_group_is_shut_down_at_once(gloo_groups, monkeypatch, caplog):
    calls = _recording_shutdown(monkeypatch, parties=len(gloo_groups))
    with caplog.at_level(logging.WARNING, logger="sftprof"):
        destroy_process_groups(together=True)
    # each group shut down in its own thread, all past the barrier together (then torch's own calls)
    assert {id(pg) for pg in calls[:len(gloo_groups)]} == {id(pg) for pg in gloo_groups}
    assert caplog.records == [] and not dist.is_initialized()


def test_a_failed_shutdown_is_a_warning_and_destroy_process_group_still_runs(gloo_groups, monkeypatch, caplog):
    _recording_shutdown(monkeypatch, parties=None, fail=True)
    with caplog.at_level(logging.WARNING, logger="sftprof"):
        destroy_process_groups(together=True)
    assert not dist.is_initialized()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == len(gloo_groups) and all(m.endswith("shutdown failed (shutdown refused); "
                                                               "destroy_process_group shuts it down") for m in warned)


def test_a_failed_trial_leaves_the_teardown_to_torch(gloo_groups, monkeypatch):
    """No group is shut down from the thread pool: every shutdown call comes from this thread, torch's own."""
    threads = []
    real = dist.ProcessGroup.shutdown

    def shutdown(pg):
        threads.append(threading.current_thread().name)
        real(pg)
    monkeypatch.setattr(dist.ProcessGroup, "shutdown", shutdown)
    destroy_process_groups(together=False)
    assert not dist.is_initialized()
    assert set(threads) == {threading.current_thread().name}
