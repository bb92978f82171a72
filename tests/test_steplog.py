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
