"""The rank entry point, started on every rank by torch's launcher: ``python -m zerorun.worker --recipe-file F``.

It initializes the process group, loads the user's model and data, wraps the model in zerorun's ZeRO engine
and trains, reporting to the launcher only through telemetry events on stdout (``telemetry/events.py``).
Exit codes: 0 done, 1 crashed, 2 bad user input (model or data module).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import socket
import sys
import time
import traceback
import warnings

from zerorun.errors import ZerorunError
from zerorun.recipe import Recipe
from zerorun.schedule import continue_schedule, lr_multiplier  # noqa: F401 (lr_multiplier: API)
from zerorun.stopsignal import STOPPED_EXIT, Stopped, StopRequest
from zerorun.telemetry import rankstream
from zerorun.telemetry.events import emit
from zerorun.telemetry.probes import cuda_memory, flops_per_token, host_memory
from zerorun.telemetry.steplog import StepLog


#: Wordings of a collective that failed because another rank went away or went quiet (Note [Blame] in
#: launch/supervisor.py). gloo (third_party/gloo/gloo/transport/tcp/pair.cc, unbound_buffer.cc): "Connection
#: closed by peer [addr]", "Read error [addr]: Connection reset by peer", "Socket Timeout", "Socket closed",
#: "Timed out waiting 30000ms for recv operation to complete", "Application timeout caused pair closure";
#: NCCL (ProcessGroupNCCL.cpp, nccl.h's ncclRemoteError): "Watchdog caught collective operation timeout:
#: WorkNCCL(...) ran for 30000 milliseconds before timing out", "Some NCCL operations have failed or timed out",
#: "NCCL communicator was aborted", "remote process exited or there was a network error"; the OS's
#: ECONNRESET/EPIPE/ECONNREFUSED texts.
_PEER_FAILURE = re.compile(
    r"connection (reset|closed|refused)|broken pipe|socket (timeout|closed)|timed out|timing out|"
    r"timeout caused pair closure|pair closure|collective operation timeout|"
    r"NCCL communicator was aborted|remote process exited|network error|ncclRemoteError|"
    r"ProcessGroup.*(abort|shut ?down)", re.I)


def is_peer_failure(e: BaseException) -> bool:
    """True for an error raised inside a collective because another rank went away (Note [Blame] in
    launch/supervisor.py): gloo's and NCCL's reset or closed connections, timeouts, pair closures, an aborted
    communicator (the wordings are listed at ``_PEER_FAILURE``)."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", ())
    return isinstance(e, dist_error) or bool(_PEER_FAILURE.search(str(e)))


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(recipe: Recipe, rank: int) -> None:
    """Train ``recipe`` on this rank; emits start, model_ready, step, eval and finish events."""
    import psutil
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler, default_collate

    from zerorun import checkpoint, zero
    from zerorun.data import build_datasets, eval_batches
    from zerorun.userload import UserCodeError, build_model, extract_loss

    t_start = time.time()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    emit("phase", rank, phase="joining the process group")  # Note [Rank phases] in telemetry/phases.py
    if cuda:
        torch.cuda.set_device(device)
    # on CUDA the communicators are made here, for this rank's device, not lazily at the first collective
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}),
                            timeout=datetime.timedelta(seconds=recipe.launch.collective_timeout_s))
    world_size = dist.get_world_size()
    from zerorun import allocator

    emit("start", rank, host=socket.gethostname(), pid=os.getpid(), torch=torch.__version__, device=str(device),
         allocator=allocator.name(), world_size=world_size, local_rank=local_rank, **host_memory(),
         **cuda_memory(device))
    emit("phase", rank, phase="building the model")
    t = recipe.train
    torch.manual_seed(t.seed)
    z = recipe.zero
    source = recipe.model.source()  # (module, factory, kwargs); model.hf: zerorun/hf/model.py
    if z.stage == 3 and z.meta_init and recipe.runtime == "zero":
        # built on the meta device; each rank materializes only its slices (zero/deferred.py), replayed on the
        # CPU as the normal path below builds it, kept on this rank's device
        with warnings.catch_warnings(record=True) as caught:  # a fallback to normal construction: say so
            warnings.simplefilter("always")
            model = zero.deferred_init(build_model, *source)
        for w in caught:
            if not str(w.message).startswith("deferred_init:"):  # the user's own: as without the recording
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            elif rank == 0:
                emit("log", rank, message=str(w.message))
        if zero.is_deferred(model):
            zero.place_on(model, device)
    else:
        model = build_model(*source).to(device)
    emit("phase", rank, phase="loading data")
    train_set, val_set = build_datasets(recipe.data, progress=lambda message: emit("log", rank, message=message))
    per_step = world_size * t.micro_batch_size
    if len(train_set) < per_step:
        raise UserCodeError(f"data: {len(train_set)} training samples, fewer than one micro-batch on every rank "
                            f"({world_size} ranks x {t.micro_batch_size})")
    opt = t.optimizer.kwargs()
    emit("phase", rank, phase="setting up ZeRO")
    groups = zero.default_param_groups(model, opt.pop("weight_decay"), t.optimizer.decay_1d)
    try:
        config = zero.ZeroConfig(stage=z.stage, bucket_mb=z.bucket_mb, grad_accum_steps=t.grad_accum_steps,
                                 grad_clip=t.grad_clip, units=tuple(z.units), prefetch=z.prefetch,
                                 prefetch_bytes=z.prefetch_bytes,
                                 persistence_threshold=z.persistence_threshold,
                                 activation_checkpointing=t.activation_checkpointing,
                                 precision=recipe.precision, reduce_dtype=z.reduce_dtype,
                                 loss_scale=zero.LossScaleConfig(**recipe.loss_scale.model_dump()),
                                 offload_optimizer=z.offload_optimizer, offload_params=z.offload_params,
                                 offload_path=z.offload_path,
                                 offload_buffer_mb=z.offload_buffer_mb, grad_accum_dtype=z.grad_accum_dtype,
                                 broadcast_buffers=z.broadcast_buffers)
        if recipe.runtime == "zero":
            engine = zero.initialize(model, optimizer=t.optimizer.name, optimizer_kwargs=opt, param_groups=groups,
                                     config=config, elementwise=t.optimizer.elementwise)
        else:  # a baseline for `zerorun bench`: torch's DDP or FSDP2 behind the same interface
            from zerorun.bench import baselines

            engine = baselines.initialize(recipe.runtime, model, optimizer=t.optimizer.name, optimizer_kwargs=opt,
                                          param_groups=groups, config=config)
    except ValueError as e:  # the recipe asks for something this model cannot do (units, optimizer, groups)
        raise ZerorunError(f"recipe: {e}") from None
    if getattr(model, "pretrained", None) and recipe.model.hf is not None:  # Note [Pretrained at stage 3]
        from zerorun.hf.load import load_pretrained_slices

        load_pretrained_slices(model, engine)
    n_params = sum(p.numel() for p in model.parameters())
    units = [u.name or "<root>" for u in getattr(engine, "units", [])]
    emit("model_ready", rank, params=n_params, trainable=engine.num_params, stage=recipe.zero.stage,
         runtime=recipe.runtime, model_state_bytes=engine.memory_bytes(), units=units)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lr_multiplier(t.schedule, t.steps))
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=t.seed,
                                 drop_last=True)
    torch.manual_seed(t.seed + 1 + rank)  # dropout and other training randomness differ per rank
    ckpt = recipe.checkpoint
    start, position = 0, checkpoint.DataPosition()
    if ckpt.resume:  # after everything that draws random numbers: the checkpoint restores the RNG states
        emit("phase", rank, phase="loading the checkpoint")
        start, position = checkpoint.load(ckpt.resume, engine, scheduler=scheduler,
                                          micro_batch_size=t.micro_batch_size)
        continue_schedule(scheduler)  # this recipe's schedule from the saved step (Note [LR schedule on resume])
        emit("log", rank, message=f"resumed from {ckpt.resume} after step {start}")

    def to_device(batch):
        if isinstance(batch, torch.Tensor):
            return batch.to(device, non_blocking=True)
        if isinstance(batch, dict):
            return {k: to_device(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(to_device(v) for v in batch)
        return batch

    def tokens_in(batch) -> int:
        x = batch if isinstance(batch, torch.Tensor) else None
        if isinstance(batch, dict):
            x = batch.get("input_ids", next((v for v in batch.values() if isinstance(v, torch.Tensor)), None))
        if x is None or x.dim() < 2:
            return 0
        return x.shape[0] * (x.shape[1] - 1 if recipe.data.kind in ("text", "hf") else x.shape[1])

    def evaluate(step: int) -> None:
        """The exact mean loss over the validation samples (every one once, over all ranks: ``data.eval_batches``;
        the forward's loss taken as its batch's mean), and how many there were."""
        if val_set is None or len(val_set) == 0:
            return
        plan = eval_batches(len(val_set), rank, world_size, t.micro_batch_size, t.eval_batches)
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of per-sample losses, samples
        with torch.no_grad():
            for indices in plan:
                batch = to_device(default_collate([val_set[i] for i in indices or [0]]))
                loss = extract_loss(engine(batch), source[0]).detach().double()
                if indices:  # an empty one only keeps the forwards in step with the other ranks
                    total += torch.stack([loss * len(indices), loss.new_tensor(len(indices))])
        model.train()
        dist.all_reduce(total)
        if rank == 0:
            emit("eval", rank, step=step, val_loss=float(total[0] / total[1]), samples=int(total[1]))

    it = checkpoint.batch_stream(train_set, sampler, t.micro_batch_size, position)
    model.train()
    proc = psutil.Process()
    comm_prev = engine.comm_stats()
    first_step_s = None
    shape = getattr(model, "shape", None)
    interval_steps, interval_s = 0, 0.0  # training steps and their time since the last step event
    steplog = StepLog(rank, world_size, device, clipped=bool(t.grad_clip))
    stop = StopRequest(rank, world_size) if ckpt.dir else None  # Note [Checkpoint on SIGTERM], stopsignal.py
    emit("phase", rank, phase="first step")
    if t.eval_every and start == 0:
        evaluate(0)
    for step in range(start + 1, t.steps + 1):
        t0 = time.perf_counter()
        tokens = 0
        for _ in range(t.grad_accum_steps):
            batch = to_device(next(it))
            tokens += tokens_in(batch)
            loss = extract_loss(engine(batch), source[0])
            engine.backward(loss)
            steplog.add_loss(loss)  # summed on the device, read at log steps (Note [Values read at log steps])
        grad_norm = engine.step()  # a 0-dim tensor or a float; read with the loss at log steps only
        lr = engine.optimizer.param_groups[0]["lr"]
        if not engine.last_step_skipped:  # fp16: a skipped step (overflow) does not advance the schedule
            scheduler.step()
        logged = step % recipe.log.every == 0 or step == t.steps or step == 1
        if logged and cuda:  # the interval's time is the GPU's (Note [Values read at log steps])
            torch.cuda.synchronize(device)
        step_s = time.perf_counter() - t0
        interval_steps, interval_s = interval_steps + 1, interval_s + step_s
        if first_step_s is None:
            first_step_s = time.time() - t_start
        steplog.flush()  # the previous logged step's event (Note [Deferred loss] in telemetry/steplog.py)
        steplog.progress(step, t.steps)  # rank 0: the launcher's step count moves every step
        if logged:
            with steplog.measuring():
                step_s = interval_s / interval_steps  # the mean: a step's own time is the host's on a GPU
                comm = engine.comm_stats()
                samples = t.micro_batch_size * t.grad_accum_steps
                tflops = flops_per_token(engine.num_params, shape, tokens / samples) * tokens / step_s / 1e12
                fields = dict(
                    steps=t.steps, lr=lr, grad_norm=grad_norm, step_time_s=step_s, samples_per_s=samples / step_s,
                    tokens_per_s=tokens / step_s, job_samples_per_s=world_size * samples / step_s,
                    job_tokens_per_s=world_size * tokens / step_s, rss_bytes=proc.memory_info().rss,
                    peak_rss_bytes=peak_rss_bytes(), model_state_bytes=engine.memory_bytes(),
                    comm_bytes=comm["bytes_sent"] - comm_prev["bytes_sent"],
                    comm_wait_s=None if comm["wait_s"] is None else comm["wait_s"] - comm_prev["wait_s"],
                    loss_scale=engine.loss_scale, skipped=engine.last_step_skipped,
                    skipped_steps=engine.skipped_steps, interval_steps=interval_steps,
                    interval_s=interval_s, tflops=tflops, job_tflops=world_size * tflops,
                    **host_memory(), **cuda_memory(device))
                fields["peak_rss_bytes"] = max(fields["peak_rss_bytes"], fields["rss_bytes"])  # Note [Peak RSS]
            steplog.log(step, None, fields)  # the loss: the mean since the last step event
            comm_prev = comm
            interval_steps, interval_s = 0, 0.0
        if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
            steplog.flush()
            evaluate(step)
        if ckpt.dir and ((ckpt.every and step % ckpt.every == 0) or step == t.steps):
            steplog.flush()
            path, seconds, nbytes = checkpoint.save(engine, ckpt.dir, step, scheduler=scheduler, position=position,
                                                    recipe=json.loads(recipe.model_dump_json()), keep=ckpt.keep)
            if rank == 0:
                emit("checkpoint", rank, step=step, path=path, seconds=seconds, bytes=nbytes)
        if stop is not None and step < t.steps and stop.agreed(device):
            steplog.flush()
            if not (ckpt.every and step % ckpt.every == 0):  # not saved above
                path, seconds, nbytes = checkpoint.save(engine, ckpt.dir, step, scheduler=scheduler,
                                                        position=position, keep=ckpt.keep,
                                                        recipe=json.loads(recipe.model_dump_json()))
                if rank == 0:  # a save like any other: metrics.jsonl and the summary's last checkpoint name it
                    emit("checkpoint", rank, step=step, path=path, seconds=seconds, bytes=nbytes)
            else:
                path = checkpoint.step_dir(ckpt.dir, step)
            emit("stopped", rank, step=step, steps=t.steps, signal="SIGTERM", path=path, signalled_rank=stop.rank)
            engine.close()
            dist.barrier()
            dist.destroy_process_group()
            raise Stopped(step)
    steplog.flush()
    emit("finish", rank, steps=t.steps, elapsed_s=time.time() - t_start, time_to_first_step_s=first_step_s,
         peak_rss_bytes=peak_rss_bytes(), skipped_steps=engine.skipped_steps, **cuda_memory(device))
    engine.close()  # removes the offload swap file (Note [Swap files])
    dist.barrier()  # no rank tears its process group down while a peer may still be using it
    dist.destroy_process_group()


def read_recipe(path: str, environ=os.environ) -> Recipe:
    """The resolved recipe the launcher wrote to ``path``; a ``launch.env`` value written masked (``--dry-run``'s
    file: Note [Masked environment values]) is the one this rank's environment got from the command line."""
    from zerorun.recipe import MASK

    with open(path, encoding="utf-8") as f:
        data = json.loads(f.read())
    env = (data.get("launch") or {}).get("env") or {}
    for key, value in env.items():
        if value == MASK and key in environ:
            env[key] = environ[key]
    return Recipe.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    """Parse ``--recipe-file`` (the resolved recipe as JSON, in a 0600 file the node's watcher wrote: never on
    a command line, Note [Node watcher] in launch/node.py), train, and return the exit code."""
    parser = argparse.ArgumentParser(prog="zerorun.worker")
    parser.add_argument("--recipe-file", required=True)
    args = parser.parse_args(argv)
    from zerorun.zero import allocator

    allocator.configure()  # Note [Returning freed memory]: every runtime, baselines included, before torch allocates
    rank = int(os.environ.get("RANK", 0))
    rankstream.install(rank)  # Note [Rank streams] in telemetry/rankstream.py
    emit("phase", rank, phase="importing torch")  # Note [Rank phases] in telemetry/phases.py
    threads = os.environ.get("OMP_NUM_THREADS")
    try:
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        train(read_recipe(args.recipe_file), rank)
        return 0
    except Stopped:  # SIGTERM, checkpoint saved (Note [Checkpoint on SIGTERM])
        return STOPPED_EXIT
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the launcher
        return report_failure(e, rank)


def report_failure(e: BaseException, rank: int) -> int:
    """Emit the error event for ``e`` (raised on ``rank``) and return the rank's exit code: 2 for a
    :class:`ZerorunError` (bad user input), 130 for Ctrl-C, else 1."""
    if isinstance(e, ZerorunError):
        emit("error", rank, type=type(e).__name__, message=str(e), user_error=True)
        return 2
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    tb = "".join(tb).strip().splitlines()
    frames = traceback.extract_tb(e.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None
    emit("error", rank, type=type(e).__name__, message=str(e).strip().splitlines()[0] if str(e).strip() else "",
         traceback="\n".join(tb[-12:]), user_error=False, peer_failure=is_peer_failure(e), where=where)
    return 130 if isinstance(e, KeyboardInterrupt) else 1


if __name__ == "__main__":
    sys.exit(main())
