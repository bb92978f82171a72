"""The rank's training loop: :class:`TrainingRun`, one object whose methods are the phases of a run on one rank
(set up, build the model, load the data, set up ZeRO, resume, one step, log, eval, save, stop, finish).

It reports to the launcher only through telemetry events on stdout (``telemetry/events.py``): ``phase`` as each
phase starts (Note [Rank phases] in telemetry/phases.py), ``start``, ``model_ready``, ``step``, ``eval``,
``checkpoint``, ``stopped`` and ``finish``. A steady training step reads no tensor value on the host except at
log steps (Note [Values read at log steps] in telemetry/steplog.py; tests/test_worker_syncs.py).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import warnings
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from zerorun import checkpoint, zero
from zerorun.errors import ZerorunError
from zerorun.rank.data import batch_stream, build_datasets, check_sizes, eval_batches, to_device, tokens_in
from zerorun.rank.schedule import continue_schedule, lr_multiplier
from zerorun.rank.stopsignal import Stopped, StopRequest
from zerorun.rank.userload import build_model, extract_loss
from zerorun.recipe import Recipe
from zerorun.telemetry.events import emit
from zerorun.telemetry.probes import cuda_memory, flops_per_token, host_memory, peak_rss_bytes
from zerorun.telemetry.steplog import StepLog


def train(recipe: Recipe, rank: int) -> None:
    """Train ``recipe`` on this rank; emits start, model_ready, step, eval, checkpoint and finish events.

    Raises:
        Stopped: SIGTERM, the checkpoint saved (Note [Checkpoint on SIGTERM] in rank/stopsignal.py).
        ZerorunError: bad user input (recipe, model, data, checkpoint).
    """
    TrainingRun(recipe, rank).run()


class TrainingRun:
    """One rank's training run of ``recipe``; each phase is a method, what a phase makes is an attribute.

    Attributes (once their phase has run): ``device`` (this rank's), ``world_size``, ``model`` (the user's
    module), ``train_set``/``val_set`` (map-style datasets; ``val_set`` may be None), ``engine`` (zerorun's
    ZeRO engine or a baseline behind its interface), ``scheduler`` (LambdaLR), ``start`` (the last step done
    before this run: 0, or the resumed checkpoint's), ``position`` (the data position, kept up to date by
    ``batches``, saved with every checkpoint).
    """

    def __init__(self, recipe: Recipe, rank: int) -> None:
        self.recipe, self.rank = recipe, rank
        self.t = recipe.train
        self.t_start = time.time()
        self.start, self.position = 0, checkpoint.DataPosition()

    def run(self) -> None:
        """Every phase in order; returns when ``train.steps`` are done (raises Stopped on SIGTERM)."""
        self.set_up()
        self.build_model()
        deferred = zero.is_deferred(self.model)  # Note [Data after the model's random draws]
        if not deferred:
            self.load_data()  # before the engine: a data error is said first
        self.set_up_zero()
        if deferred:
            self.load_data("loading data after the model")
        self.deal_samples()
        self.resume()
        self.start_loop()
        try:
            for step in range(self.start + 1, self.t.steps + 1):
                self.one_step(step)
                self.after_step(step)
        except BaseException:
            self.steplog.flush_if_done()  # the last step done before a failure (Note [Deferred loss])
            raise
        self.finish()

    # ------------------------------------------------------------------------------------------ set up
    def set_up(self) -> None:
        """This rank's device, the process group (its collective timeout the recipe's), the start event and the
        model's seed."""
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", self.local_rank) if self.cuda else torch.device("cpu")
        emit("phase", self.rank, phase="joining the process group")  # Note [Rank phases] in telemetry/phases.py
        if self.cuda:
            torch.cuda.set_device(self.device)
        # on CUDA the communicators are made here, for this rank's device, not lazily at the first collective
        dist.init_process_group("nccl" if self.cuda else "gloo",
                                **({"device_id": self.device} if self.cuda else {}),
                                timeout=datetime.timedelta(seconds=self.recipe.launch.collective_timeout_s))
        self.world_size = dist.get_world_size()
        from zerorun import allocator

        emit("start", self.rank, host=socket.gethostname(), pid=os.getpid(), torch=torch.__version__,
             device=str(self.device), allocator=allocator.name(), world_size=self.world_size,
             local_rank=self.local_rank, **host_memory(), **cuda_memory(self.device))
        emit("phase", self.rank, phase="building the model")
        torch.manual_seed(self.t.seed)

    def build_model(self) -> None:
        """The user's model on this rank's device; at stage 3 with ``zero.meta_init``, built on the meta device
        and each rank materializes only its slices (zero/deferred.py)."""
        recipe, rank = self.recipe, self.rank
        z = recipe.zero
        self.source = recipe.model.source()  # (module, factory, kwargs); model.hf: zerorun/hf/model.py
        if not (z.stage == 3 and z.meta_init and recipe.runtime == "zero"):
            self.model = build_model(*self.source).to(self.device)
            return
        # replayed on the CPU as the normal path builds it, kept on this rank's device
        with warnings.catch_warnings(record=True) as caught:  # a fallback to normal construction: say so
            warnings.simplefilter("always")
            self.model = zero.deferred_init(build_model, *self.source)
        for w in caught:
            if not str(w.message).startswith("deferred_init:"):  # the user's own: as without the recording
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            elif rank == 0:
                emit("log", rank, message=str(w.message))
        if zero.is_deferred(self.model):
            zero.place_on(self.model, self.device)

    def load_data(self, phase: str = "loading data") -> None:
        """The training and validation sets (``data``); raises UserCodeError when the training set holds fewer
        samples than one micro-batch on every rank. ``phase``: the rank's phase event (Note [Rank phases])."""
        rank = self.rank
        emit("phase", rank, phase=phase)
        self.train_set, self.val_set, self.collate = build_datasets(
            self.recipe.data, progress=lambda message: emit("log", rank, message=message))
        note = check_sizes(self.recipe.data, self.train_set, self.val_set, self.world_size, self.t)
        if note and rank == 0:
            emit("log", rank, message=note)

    def set_up_zero(self) -> None:
        """The engine (``runtime``: zerorun's ZeRO, or torch's DDP/FSDP2 for `zerorun bench`), pretrained
        weights at stage 3, the model_ready event and the LR scheduler.

        Raises:
            ZerorunError: the recipe asks for something this model cannot do (units, optimizer, groups).
        """
        recipe, t = self.recipe, self.t
        opt = t.optimizer.kwargs()
        emit("phase", self.rank, phase="setting up ZeRO")
        groups = zero.default_param_groups(self.model, opt.pop("weight_decay"), t.optimizer.decay_1d)
        try:
            config = _zero_config(recipe)
            if recipe.runtime == "zero":
                self.engine = zero.initialize(self._compiled(), optimizer=t.optimizer.name, optimizer_kwargs=opt,
                                              param_groups=groups, config=config, elementwise=t.optimizer.elementwise)
            else:  # a baseline for `zerorun bench`: torch's DDP or FSDP2 behind the same interface
                from zerorun.bench import baselines

                self.engine = baselines.initialize(recipe.runtime, self.model, optimizer=t.optimizer.name,
                                                   optimizer_kwargs=opt, param_groups=groups, config=config)
        except ValueError as e:
            raise ZerorunError(f"recipe: {e}") from None
        if getattr(self.model, "pretrained", None) and recipe.model.hf is not None:  # Note [Pretrained at stage 3]
            from zerorun.hf.load import load_pretrained_slices

            load_pretrained_slices(self.model, self.engine)
        units = [u.name or "<root>" for u in getattr(self.engine, "units", [])]
        if units and self.rank == 0 and recipe.runtime == "zero":  # what stage 3 gathers, and the bytes of each
            for line in self.engine.describe_units():
                emit("log", self.rank, message=line)
        emit("model_ready", self.rank, params=sum(p.numel() for p in self.model.parameters()),
             trainable=self.engine.num_params, stage=recipe.zero.stage, runtime=recipe.runtime,
             model_state_bytes=self.engine.memory_bytes(), units=units)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.engine.optimizer, lr_multiplier(t.schedule, t.steps))

    def deal_samples(self) -> None:
        """The sampler that deals the training samples to the ranks, and the per-rank seed of training's own
        random numbers (dropout).

        Note [Data after the model's random draws]: as in a plain script (``torch.manual_seed``, the model, the
        data), the data factory runs after the model's construction has drawn its random numbers, so a factory
        that draws some (a random split, synthetic data) gets the same ones at every stage. With ``zero.meta_init``
        at stage 3 those draws happen in the replay of the construction (zero/deferred.py), inside
        ``zero.initialize``: the data is loaded after it there (it got the seed's first numbers instead, and with
        them other data than stages 0-2: a review), and before the engine elsewhere, so that a data error comes
        first."""
        t = self.t
        self.sampler = DistributedSampler(self.train_set, num_replicas=self.world_size, rank=self.rank,
                                          shuffle=True, seed=t.seed, drop_last=True)
        torch.manual_seed(t.seed + 1 + self.rank)  # dropout and other training randomness differ per rank

    def _compiled(self) -> torch.nn.Module:
        """The model to give ``zero.initialize``: ``torch.compile(model)`` with ``model.compile``'s backend, which
        the engine compiles again where its stage can run compiled code (Note [Compiling per unit] in
        zero/compiling.py; ``self.model`` stays the user's module), or the model itself."""
        backend = self.recipe.model.compile_backend()
        if backend is None:
            return self.model
        if self.rank == 0:
            where = "each unit's forward (the code between units runs eagerly)" if self.recipe.zero.stage == 3 \
                else "the whole forward"
            emit("log", self.rank, message=f"model.compile: {backend} compiles {where}; the first step compiles")
        return torch.compile(self.model, backend=backend)

    def resume(self) -> None:
        """Load ``checkpoint.resume``, if set: after everything that draws random numbers, since the checkpoint
        restores the RNG states (Note [Exact resume] in checkpoint/saving.py)."""
        path = self.recipe.checkpoint.resume
        if not path:
            return
        emit("phase", self.rank, phase="loading the checkpoint")
        self.start, self.position = checkpoint.load(path, self.engine, scheduler=self.scheduler,
                                                    micro_batch_size=self.t.micro_batch_size)
        continue_schedule(self.scheduler)  # this recipe's schedule from the saved step (Note [LR schedule on resume])
        emit("log", self.rank, message=f"resumed from {path} after step {self.start}", resumed_step=self.start)

    def start_loop(self) -> None:
        """The batch stream from the data position, the step log, the SIGTERM watch (with ``checkpoint.dir``),
        and the eval before the first step of a fresh run."""
        t = self.t
        self.batches = batch_stream(self.train_set, self.sampler, t.micro_batch_size, self.position, self.collate)
        self.model.train()
        self.proc = psutil.Process()
        self.comm_prev = self.engine.comm_stats()
        self.first_step_s = None
        self.shape = getattr(self.model, "shape", None)  # for the FLOPs of a step
        self.interval_steps, self.interval_s = 0, 0.0  # training steps and their time since the last step event
        self.unlogged = None  # (step, tokens, grad norm, lr) of a step past the last step event
        self.steplog = StepLog(self.rank, self.world_size, self.device, clipped=bool(t.grad_clip))
        # Note [Checkpoint on SIGTERM] in rank/stopsignal.py
        self.stop = StopRequest(self.rank, self.world_size) if self.recipe.checkpoint.dir else None
        emit("phase", self.rank, phase="first step")
        if t.eval_every and self.start == 0:
            self._between_steps(self.evaluate, 0)

    # ---------------------------------------------------------------------------------------------- steps
    def one_step(self, step: int) -> None:
        """Training step ``step``: ``train.grad_accum_steps`` micro-batches forward and backward, the optimizer
        step, the scheduler, and the step's event at log steps. Reads no tensor value except at log steps."""
        t = self.t
        t0 = time.perf_counter()
        tokens = 0
        for _ in range(t.grad_accum_steps):
            batch = to_device(next(self.batches), self.device)
            tokens += tokens_in(batch, self.recipe.data.kind in ("text", "hf"))
            loss = extract_loss(self.engine(batch), self.source[0])
            self.engine.backward(loss)
            self.steplog.add_loss(loss)  # summed on the device, read at log steps (Note [Values read at log steps])
        grad_norm = self.engine.step()  # a 0-dim tensor or a float; read with the loss at log steps only
        lr = self.engine.optimizer.param_groups[0]["lr"]
        if not self.engine.last_step_skipped:  # fp16: a skipped step (overflow) does not advance the schedule
            self.scheduler.step()
        logged = step % self.recipe.log.every == 0 or step == t.steps or step == 1
        if logged and self.cuda:  # the interval's time is the GPU's (Note [Values read at log steps])
            torch.cuda.synchronize(self.device)
        step_s = time.perf_counter() - t0
        self.interval_steps, self.interval_s = self.interval_steps + 1, self.interval_s + step_s
        if self.first_step_s is None:
            self.first_step_s = time.time() - self.t_start
        self.steplog.flush()  # the previous logged step's event (Note [Deferred loss] in telemetry/steplog.py)
        self.steplog.progress(step, t.steps)  # rank 0: the launcher's step count moves every step
        self.unlogged = None if logged else (step, tokens, grad_norm, lr)  # a stop logs it (after_step)
        if logged:
            self._log_step(step, tokens, grad_norm, lr)

    def _log_step(self, step: int, tokens: int, grad_norm: Any, lr: float) -> None:
        """The step event of ``step``: throughput over the interval since the last one, memory, communication;
        the loss is the mean since the last step event."""
        t, world_size, engine = self.t, self.world_size, self.engine
        with self.steplog.measuring():
            step_s = self.interval_s / self.interval_steps  # the mean: a step's own time is the host's on a GPU
            comm, prev = engine.comm_stats(), self.comm_prev
            samples = t.micro_batch_size * t.grad_accum_steps
            tflops = flops_per_token(engine.num_params, self.shape, tokens / samples) * tokens / step_s / 1e12
            fields = dict(
                steps=t.steps, lr=lr, grad_norm=grad_norm, step_time_s=step_s, samples_per_s=samples / step_s,
                tokens_per_s=tokens / step_s, job_samples_per_s=world_size * samples / step_s,
                job_tokens_per_s=world_size * tokens / step_s, rss_bytes=self.proc.memory_info().rss,
                peak_rss_bytes=peak_rss_bytes(), model_state_bytes=engine.memory_bytes(),
                comm_bytes=comm["bytes_sent"] - prev["bytes_sent"],
                comm_bytes_inter_node=None if comm.get("bytes_inter_node") is None
                else comm["bytes_inter_node"] - prev["bytes_inter_node"],
                comm_wait_s=None if comm["wait_s"] is None else comm["wait_s"] - prev["wait_s"],
                loss_scale=engine.loss_scale, skipped=engine.last_step_skipped,
                skipped_steps=engine.skipped_steps, interval_steps=self.interval_steps,
                interval_s=self.interval_s, tflops=tflops, job_tflops=world_size * tflops,
                **host_memory(), **cuda_memory(self.device))
            fields["peak_rss_bytes"] = max(fields["peak_rss_bytes"], fields["rss_bytes"])  # Note [Peak RSS]
        self.steplog.log(step, None, fields)  # the loss: the mean since the last step event
        self.comm_prev = comm
        self.interval_steps, self.interval_s = 0, 0.0

    def after_step(self, step: int) -> None:
        """Eval every ``train.eval_every`` steps and at the last, save every ``checkpoint.every`` steps and at the
        last (with ``checkpoint.dir``), and stop if SIGTERM came to any rank."""
        t, ckpt = self.t, self.recipe.checkpoint
        if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
            self.steplog.flush()
            self._between_steps(self.evaluate, step)
        if ckpt.dir and ((ckpt.every and step % ckpt.every == 0) or step == t.steps):
            self.steplog.flush()
            self.save(step)
        if self.stop is not None and step < t.steps and self.stop.agreed():
            if self.unlogged is not None:  # the steps since the last step event, else in no event and no tracker
                self._log_step(*self.unlogged)
            self.steplog.flush()
            self.stop_after(step)

    def _between_steps(self, work, step: int) -> None:
        """``work(step)`` (an evaluation) with its collectives left out of the next step event's ``comm_*``
        figures (its forwards' all-gathers were counted in the next step's bytes): the counts before it move by
        what it sent and waited."""
        before = self.engine.comm_stats()
        work(step)
        after = self.engine.comm_stats()
        self.comm_prev = {k: v if v is None or after[k] is None else v + after[k] - before[k]
                          for k, v in self.comm_prev.items()}

    # ------------------------------------------------------------------------------------ eval, save, end
    def evaluate(self, step: int) -> None:
        """The exact mean loss over the validation samples (every one once, over all ranks: ``data.eval_batches``;
        the forward's loss taken as its batch's mean), and how many there were: rank 0's eval event."""
        val_set, rank, device = self.val_set, self.rank, self.device
        if val_set is None or len(val_set) == 0:
            return
        plan = eval_batches(len(val_set), rank, self.world_size, self.t.micro_batch_size, self.t.eval_batches)
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of per-sample losses, samples
        with torch.no_grad():
            for indices in plan:
                batch = to_device(self.collate([val_set[i] for i in indices or [0]]), device)
                loss = extract_loss(self.engine(batch), self.source[0]).detach().double()
                if indices:  # an empty one only keeps the forwards in step with the other ranks
                    total += torch.stack([loss * len(indices), loss.new_tensor(len(indices))])
        self.model.train()
        dist.all_reduce(total)
        if rank == 0:
            emit("eval", rank, step=step, val_loss=float(total[0] / total[1]), samples=int(total[1]))

    def save(self, step: int) -> str:
        """Save the checkpoint of ``step`` into ``checkpoint.dir`` (collective); rank 0 reports it in a
        checkpoint event (metrics.jsonl and the summary's last checkpoint name it). Returns its folder."""
        ckpt = self.recipe.checkpoint
        path, seconds, nbytes = checkpoint.save(self.engine, ckpt.dir, step, scheduler=self.scheduler,
                                                position=self.position, keep=ckpt.keep,
                                                recipe=json.loads(self.recipe.model_dump_json()))
        if self.rank == 0:
            emit("checkpoint", self.rank, step=step, path=path, seconds=seconds, bytes=nbytes)
        return path

    def stop_after(self, step: int) -> None:
        """SIGTERM came (Note [Checkpoint on SIGTERM] in rank/stopsignal.py): save ``step`` unless it was just
        saved, report a stopped event, tear the process group down and raise Stopped."""
        ckpt = self.recipe.checkpoint
        if not (ckpt.every and step % ckpt.every == 0):  # not saved in after_step
            path = self.save(step)
        else:
            path = checkpoint.step_dir(ckpt.dir, step)
        emit("stopped", self.rank, step=step, steps=self.t.steps, signal="SIGTERM", path=path,
             signalled_rank=self.stop.rank)
        self._close()
        raise Stopped(step)

    def finish(self) -> None:
        """The finish event (elapsed time, time to the first step, peak memory), then the engine closed and the
        process group torn down."""
        self.steplog.flush()
        emit("finish", self.rank, steps=self.t.steps, elapsed_s=time.time() - self.t_start,
             time_to_first_step_s=self.first_step_s, peak_rss_bytes=peak_rss_bytes(),
             skipped_steps=self.engine.skipped_steps, **cuda_memory(self.device))
        self._close()

    def _close(self) -> None:
        self.engine.close()  # removes the offload swap file (Note [Swap files])
        dist.barrier()  # no rank tears its process group down while a peer may still be using it
        dist.destroy_process_group()


def _zero_config(recipe: Recipe) -> zero.ZeroConfig:
    """The engine's configuration from the recipe's ``zero``, ``train``, ``precision`` and ``loss_scale``.

    Raises:
        ValueError: a combination the engine refuses.
    """
    z, t = recipe.zero, recipe.train
    return zero.ZeroConfig(stage=z.stage, bucket_mb=z.bucket_mb, grad_accum_steps=t.grad_accum_steps,
                           grad_clip=t.grad_clip, units=tuple(z.units), prefetch=z.prefetch,
                           prefetch_bytes=z.prefetch_bytes, persistence_threshold=z.persistence_threshold,
                           activation_checkpointing=t.activation_checkpointing,
                           precision=recipe.precision, reduce_dtype=z.reduce_dtype,
                           loss_scale=zero.LossScaleConfig(**recipe.loss_scale.model_dump()),
                           offload_optimizer=z.offload_optimizer, offload_params=z.offload_params,
                           offload_path=z.offload_path,
                           offload_buffer_mb=z.offload_buffer_mb, grad_accum_dtype=z.grad_accum_dtype,
                           broadcast_buffers=z.broadcast_buffers, hierarchy=z.hierarchy,
                           quantize_weights=z.quantize_weights, quantize_grads=z.quantize_grads,
                           quantize_block=z.quantize_block,
                           **({} if z.keep_root_bytes is None else {"keep_root_bytes": z.keep_root_bytes}))
