"""The worker's training loop reads no tensor value between log steps (Note [Values read at log steps] in
telemetry/steplog.py): one rank, in this process, under tests/host_syncs.py's counter, and init_process_group
given the rank's device on CUDA (checked with the CUDA calls stubbed: no GPU here)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from host_syncs import HostSyncCounter
from zerorun.rank import worker
from zerorun.recipe import load_recipe
from zerorun.telemetry.events import parse_line
from zerorun.telemetry.steplog import StepLog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


def _one_rank(monkeypatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)


def test_losses_and_norms_are_read_at_log_steps_only(monkeypatch, capfd, tmp_path):
    """7 steps of 2 micro-steps, a step event at steps 1, 3, 6 and 7: the worker and its step log read 4
    values in all (one per event: the loss and grad norm, read together), not one per micro-step; each
    event's loss is the mean over the micro-steps since the previous one, its step time the mean step time."""
    _one_rank(monkeypatch)
    recipe = load_recipe(TINY, ["train.steps=7", "log.every=3", "train.grad_accum_steps=2", "train.eval_every=0",
                                "zero.stage=1", f"log.dir={tmp_path}"])
    losses = []
    original = StepLog.add_loss

    def spy(self, loss):
        losses.append(loss.detach().clone())
        original(self, loss)

    monkeypatch.setattr(StepLog, "add_loss", spy)
    counter = HostSyncCounter()
    with counter:
        worker.train(recipe, 0)
    assert not dist.is_initialized()
    own = {site: n for site, n in counter.sites.items() if site.startswith(("zerorun/rank/worker.py",
                                                                            "zerorun/rank/loop.py",
                                                                            "zerorun/telemetry/"))}
    assert sum(own.values()) == 4, f"reads in the worker's loop: {own}"
    events = [parse_line(line) for line in capfd.readouterr().out.splitlines()]
    steps = [e.data for e in events if e is not None and e.kind == "step"]
    assert [e["step"] for e in steps] == [1, 3, 6, 7]
    per_step = [float(sum(losses[i:i + 2])) / 2 for i in range(0, 14, 2)]
    for e, (lo, hi) in zip(steps, [(0, 1), (1, 3), (3, 6), (6, 7)]):
        assert e["loss"] == pytest.approx(sum(per_step[lo:hi]) / (hi - lo), rel=1e-6), (e, per_step)
        assert e["interval_steps"] == hi - lo and e["grad_norm"] > 0
        # a step's own host time means nothing on a GPU without a read per step: the interval's mean
        assert e["step_time_s"] == pytest.approx(e["interval_s"] / e["interval_steps"], rel=1e-9), e
        assert e["samples_per_s"] == pytest.approx(8 / e["step_time_s"], rel=1e-9), e


def test_init_process_group_gets_the_rank_device_on_cuda(monkeypatch, tmp_path):
    """On CUDA the process group is made with ``device_id`` (communicators made eagerly, for this device);
    on CPU without it."""
    _one_rank(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    recipe = load_recipe(TINY, [f"log.dir={tmp_path}"])
    seen = []

    class Stop(Exception):
        pass

    def init(backend, **kwargs):
        seen.append((backend, kwargs.get("device_id")))
        raise Stop

    monkeypatch.setattr(dist, "init_process_group", init)
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        with pytest.raises(Stop):
            worker.train(recipe, 1)
    assert seen == [("nccl", torch.device("cuda", 1)), ("gloo", None)]


@pytest.mark.parametrize("value", [True, False])
def test_recipe_broadcast_buffers_reaches_the_engine(monkeypatch, tmp_path, value):
    """``zero.broadcast_buffers`` (default true) flows from the recipe into the engine's ZeroConfig."""
    from zerorun import zero

    _one_rank(monkeypatch)
    overrides = [f"log.dir={tmp_path}"] + ([] if value else ["zero.broadcast_buffers=false"])
    recipe = load_recipe(TINY, overrides)
    seen = []

    class Stop(Exception):
        pass

    def initialize(model, **kwargs):
        seen.append(kwargs["config"].broadcast_buffers)
        raise Stop

    monkeypatch.setattr(zero, "initialize", initialize)
    try:
        with pytest.raises(Stop):
            worker.train(recipe, 0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert seen == [value]


def test_recipe_refuses_a_broadcast_buffers_that_is_not_a_boolean():
    from zerorun.errors import ZerorunError

    with pytest.raises(ZerorunError, match=r"zero\.broadcast_buffers"):
        load_recipe(TINY, ["zero.broadcast_buffers=sometimes"])


def stop_agreed_case(backend: str, signalled: tuple = (1,)) -> dict:
    """StopRequest.agreed with the job's group on ``backend``, the ranks in ``signalled`` signalled. "nccl" stands in
    by name (the group here is gloo): the agreement then goes over the gloo group made beside it (Note [Agreements
    on the host]), which is returned too, so it passes only if the flag stays on the host."""
    import signal

    from zerorun.rank.stopsignal import StopRequest
    from zerorun.zero import comm

    before, real_backend = signal.getsignal(signal.SIGTERM), dist.get_backend
    if backend == "nccl":
        dist.get_backend = lambda group=None: "nccl" if group is None else real_backend(group)
    try:
        stop = StopRequest(dist.get_rank(), dist.get_world_size())
        first = stop.agreed()
        if dist.get_rank() in signalled:
            stop.signal = signal.SIGTERM
        beside = dist.group.WORLD in comm._CONTROL_GROUPS
        return {"first": first, "second": stop.agreed(), "rank": stop.rank, "beside": beside}
    finally:
        signal.signal(signal.SIGTERM, before)
        dist.get_backend = real_backend
        comm._CONTROL_GROUPS.pop(dist.group.WORLD, None)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_sigterm_agreement_is_taken_on_the_host(ranks, backend):
    """The per-step SIGTERM check (rank/stopsignal.py) reads a host tensor on a host group, never a GPU's: a CUDA
    job makes no device sync for it every step; beside NCCL it uses the job's one gloo group for agreements."""
    for r in ranks(2).run(stop_agreed_case, backend=backend):
        assert r == {"first": False, "second": True, "rank": 1, "beside": backend == "nccl"}, r


def test_a_sigterm_every_rank_got_names_no_rank(ranks):
    """Killing torchrun's agent makes the kernel send SIGTERM to each of its ranks; the result said "stopped by
    SIGTERM (sent to rank 0)" (a review), as if one rank had been signalled. Now only a lone signalled rank is
    named."""
    for r in ranks(2).run(stop_agreed_case, backend="gloo", signalled=(0, 1)):
        assert r == {"first": False, "second": True, "rank": None, "beside": False}, r
