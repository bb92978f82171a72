"""Step events with the job-wide loss all-reduced in the background (Note [Deferred loss]), on real ranks."""

import io


def deferred_loss_case(clipped: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    from zerorun.telemetry.events import parse_line
    from zerorun.telemetry.steplog import StepLog

    import time

    rank, world = dist.get_rank(), dist.get_world_size()
    out = io.StringIO()
    log = StepLog(rank, world, torch.device("cpu"), stream=out, clipped=clipped)
    with log.measuring():
        sum(range(1000))
    before = time.time()
    log.log(1, float(rank + 1), {"steps": 3, "lr": 0.1})
    after = time.time()
    queued = out.getvalue()
    time.sleep(0.3)
    other = torch.ones(3)
    dist.all_reduce(other)  # the next step's collectives run while the loss is on its way
    log.flush()
    log.flush()  # nothing left: no second event
    [event] = [parse_line(line) for line in out.getvalue().splitlines()]
    log.log(2, float("nan") if rank == 1 else 1.0, {"steps": 3})
    try:
        log.flush()
        error = None
    except FloatingPointError as e:
        error = str(e)
    return {"queued": queued, "event": (event.kind, event.rank, event.data), "other": other.tolist(), "error": error,
            "logged_in_time": before - 0.001 <= event.time <= after + 0.001}


def test_loss_is_averaged_in_the_background_and_divergence_still_stops(ranks):
    results = ranks(2).run(deferred_loss_case)
    for rank, r in enumerate(results):
        assert r["queued"] == ""  # nothing written until the next step
        kind, event_rank, data = r["event"]
        assert (kind, event_rank, data["step"], data["loss"], data["lr"]) == ("step", rank, 1, 1.5, 0.1)
        assert data["telemetry_s"] > 0 and r["other"] == [2.0, 2.0, 2.0]
        assert r["logged_in_time"]  # the event's time is when the step was logged, not when it was written
        assert r["error"].startswith("the loss is nan at step 2 (diverged)")  # on every rank, not only rank 1
        assert r["error"].endswith(": lower train.optimizer.lr or set train.grad_clip")
    for r in ranks(2).run(deferred_loss_case, clipped=True):  # clipping already on: not suggested again
        assert r["error"].endswith("(diverged): lower train.optimizer.lr"), r["error"]


def first_step_nan_case() -> str:
    import torch
    import torch.distributed as dist

    from zerorun.telemetry.steplog import StepLog

    log = StepLog(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), stream=io.StringIO())
    log.log(1, float("nan") if dist.get_rank() == 0 else 1.0, {"steps": 3})
    try:
        log.flush()
    except FloatingPointError as e:
        return str(e)
    return ""


def test_a_loss_not_finite_at_step_1_is_not_called_divergence(ranks):
    """A review: NaN from the first forward was told to lower the learning rate, before any update had run."""
    for error in ranks(2).run(first_step_nan_case):
        assert error == ("the loss is nan at step 1, before any update: the model's forward or the data give it (a "
                         "log of 0, a division by 0, NaN in a sample)")


def interval_case() -> dict:
    """Losses added on the device over an interval, a tensor grad norm among the fields, with the read counted."""
    import torch
    import torch.distributed as dist

    from host_syncs import HostSyncCounter
    from zerorun.telemetry.events import parse_line
    from zerorun.telemetry.steplog import StepLog

    rank = dist.get_rank()
    out = io.StringIO()
    log = StepLog(rank, dist.get_world_size(), torch.device("cpu"), stream=out)
    with HostSyncCounter() as counter:
        for loss in (1.0, 2.0, 6.0):  # rank 1: 2, 3, 7
            log.add_loss(torch.tensor(loss + rank, dtype=torch.bfloat16 if loss == 6.0 else torch.float32))
        log.log(4, None, {"grad_norm": torch.tensor(0.3, dtype=torch.float32), "lr": 0.1})
        queued = counter.count
        log.flush()
    [event] = [parse_line(line) for line in out.getvalue().splitlines()]
    try:
        log.log(5, None, {})
        error = None
    except ValueError as e:
        error = str(e)
    return {"queued_reads": queued, "reads": counter.count, "data": event.data, "error": error}


def test_interval_mean_and_tensor_fields_read_once(ranks):
    """The event's loss is the mean over the losses added since the last event, over both ranks; a tensor
    field (the grad norm) comes out as its value; one read in all, at the flush."""
    for r in ranks(2).run(interval_case):
        assert (r["queued_reads"], r["reads"]) == (0, 1), r
        assert r["data"]["loss"] == 3.5 and r["data"]["lr"] == 0.1, r  # (1 + 2 + 6 + 2 + 3 + 7) / 6
        assert r["data"]["grad_norm"] == float(torch_float32(0.3)), r
        assert r["error"] == "step 5: no loss added since the last step event"


def torch_float32(x: float) -> float:
    import torch

    return float(torch.tensor(x, dtype=torch.float32))


def failure_case() -> dict:
    """A rank that fails after a logged step writes that step's event when its all-reduce came, never waits for one
    that did not (its peer never issued it), and keeps a non-finite loss out of the failure's own error."""
    import time

    import torch
    import torch.distributed as dist

    from zerorun.telemetry.events import parse_line
    from zerorun.telemetry.steplog import StepLog

    rank = dist.get_rank()
    out = io.StringIO()
    log = StepLog(rank, dist.get_world_size(), torch.device("cpu"), stream=out)
    if rank == 1:
        time.sleep(0.3)  # rank 0 fails at once after step 4: its peer's all-reduce comes a moment later
    log.log(4, float(rank + 1), {"steps": 8})
    log.flush_if_done()
    written = [parse_line(line).data["step"] for line in out.getvalue().splitlines()]
    waited = None
    if rank == 0:  # rank 1 never logs step 5: nothing written, no wait
        log.log(5, 1.0, {"steps": 8})
        t0 = time.monotonic()
        log.flush_if_done(wait_s=0.2)
        waited = time.monotonic() - t0
        pending = log._pending is not None
        log._pending[0]()  # rank 1's late all-reduce below lets it end
        log._pending = None
    else:
        pending = None
        time.sleep(0.5)  # after rank 0 gave up
        dist.all_reduce(torch.zeros(1, dtype=torch.float64))
    log.log(6, float("nan"), {"steps": 8})
    time.sleep(0.5)
    log.flush_if_done()  # no FloatingPointError in place of the failure's own
    return {"written": written, "waited": waited, "pending": pending,
            "after": [parse_line(line).data["step"] for line in out.getvalue().splitlines()]}


def test_a_failing_rank_writes_the_last_step_done_without_waiting(ranks):
    """A review: a rank failing at step 5 left step 4 out of metrics.jsonl and the summary (3 of 8 steps shown)."""
    results = ranks(2).run(failure_case)
    for rank, r in enumerate(results):
        assert r["written"] == [4] and r["after"] == [4], r
    assert 0.2 <= results[0]["waited"] < 0.5 and results[0]["pending"] is True  # bounded, never hangs
