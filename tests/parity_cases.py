"""Cases run on every rank of a :class:`distributed.RankPool`: a ZeRO engine against torch's DDP.

Each case trains two copies of one model from the same seed, one under ``DistributedDataParallel`` with a
per-parameter ``torch.optim`` optimizer (the reference), one under zerorun's engine, on the same per-rank
batches, and returns the largest relative differences of loss, global grad norm and final parameters.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import functools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from zerorun.zero.broadcast import ddp_buffer_kwargs
from zerorun.zero import ZeroConfig, default_param_groups, deferred_init, initialize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpt_module():
    spec = importlib.util.spec_from_file_location("zerorun_test_gpt", os.path.join(ROOT, "recipes/models/gpt.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class MLP(nn.Module):
    """Odd-sized MLP (numels not divisible by 2 or 3) with optional structures under test."""

    def __init__(self, batchnorm: bool = False, frozen: bool = False, branch: bool = False,
                 twice: bool = False) -> None:
        super().__init__()
        # A bias right before BatchNorm has an exactly-zero true gradient (BN removes the mean): its float
        # noise would be normalized by Adam into lr-sized steps of random sign, in DDP as anywhere. Models
        # drop it (bias=False), and so does this one.
        self.inp = nn.Linear(7, 13, bias=not batchnorm)
        self.norm = nn.BatchNorm1d(13) if batchnorm else nn.LayerNorm(13)
        self.hidden = nn.Linear(13, 11)
        self.branch = nn.Linear(11, 11) if branch else None
        self.out = nn.Linear(11, 5)
        self.twice = nn.Linear(11, 11) if twice else None  # one unit called twice in a forward
        if frozen:
            self.inp.requires_grad_(False)

    def forward(self, batch: dict) -> torch.Tensor:
        h = F.gelu(self.norm(self.inp(batch["x"])))
        h = F.gelu(self.hidden(h))
        if self.branch is not None and batch["use_branch"]:
            h = h + self.branch(h)
        if self.twice is not None:
            h = h + self.twice(torch.tanh(self.twice(h)))
        return F.cross_entropy(self.out(h), batch["y"])


def _build(model: str, seed: int, **model_kwargs) -> nn.Module:
    torch.manual_seed(seed)
    if model == "gpt":
        return _gpt_module().build_model(**{"vocab_size": 61, "n_layer": 2, "n_head": 2, "d_model": 18,
                                            "max_seq_len": 16, **model_kwargs})
    return MLP(**model_kwargs)


def _batch(model: str, step: int, micro: int, rank: int, world_size: int, branch_pattern: str) -> object:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    if model == "gpt":
        return torch.randint(0, 61, (4, 17), generator=g)
    use = {"never": False, "always": True,
           # taken on some ranks only, and on no rank at all in some steps
           "mixed": (step % 3 == 0) or (step % 3 == 1 and rank == 0),
           # taken on every rank or on none (stage 3 gathers a unit on all ranks together, as FSDP does)
           "uniform": step % 3 == 0}[branch_pattern]
    return {"x": torch.randn(6, 7, generator=g), "y": torch.randint(0, 5, (6,), generator=g), "use_branch": use}


def _loss(out) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) else out


def _groups(model: nn.Module, kind: str, weight_decay: float) -> list[dict]:
    if kind == "default":
        return default_param_groups(model, weight_decay)
    # "custom": three groups with their own lr and weight decay
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": params[0::3], "lr": 3e-3, "weight_decay": 0.2},
            {"params": params[1::3], "lr": 1e-3, "weight_decay": 0.0},
            {"params": params[2::3]}]


def rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    """max |a - b| / max(max |b|, 1e-12): the difference relative to the reference's scale."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def parity(stage: int, model: str = "gpt", steps: int = 20, accum: int = 1, clip: float | None = None,
           optimizer: str = "AdamW", optimizer_kwargs: dict | None = None, groups: str = "default",
           bucket_mb: float = 0.002, branch_pattern: str = "never", units: tuple = (),
           activation_checkpointing: bool = False, deferred: bool = False, persistence_threshold: int = 0,
           freeze: tuple = (), prefetch_bytes: int | None = None, broadcast_buffers: bool = True,
           hierarchy: int | str | None = None, **model_kwargs) -> dict:
    """Train DDP and the zerorun engine side by side; return the largest relative differences.

    Also trains a second DDP (``floor_*`` keys) that differs from the first only in summation order: another
    ``bucket_cap_mb``, and an all-reduce on every micro-step instead of ``no_sync`` accumulation. Its distance
    to the first is the float32 floor of any comparison (Note [Summation-order floor] in test_zero_parity.py).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # lr 1e-3 for the tiny GPT: at 1e-2 its training is chaotic enough that float-order noise (Note
    # [Summation-order floor]) grows to 1e-5 in the grad norm within 20 steps, in DDP against DDP too.
    kwargs = dict(optimizer_kwargs or {"lr": 1e-3 if model == "gpt" else 1e-2, "weight_decay": 0.1})
    wd = kwargs.pop("weight_decay", 0.0)
    models = [_build(model, 0, **model_kwargs)]
    for name, p in models[0].named_parameters():  # parameters whose names contain one of ``freeze``
        if any(f in name for f in freeze):
            p.requires_grad_(False)
    models += [copy.deepcopy(models[0]) for _ in range(2)]
    ref_model, alt_model, zero_model = models
    opts = [getattr(torch.optim, optimizer)(_groups(m, groups, wd), **kwargs) for m in (ref_model, alt_model)]
    unused = branch_pattern != "never"
    sync = ddp_buffer_kwargs(broadcast_buffers)  # DDP with the engine's zero.broadcast_buffers
    ddps = [DDP(ref_model, find_unused_parameters=unused, **sync),
            DDP(alt_model, find_unused_parameters=unused, bucket_cap_mb=0.0005, **sync)]
    if deferred:  # built on the meta device, each rank materializing its slices only
        zero_model = deferred_init(_build, model, 0, **model_kwargs)
        for name, p in zero_model.named_parameters():
            if any(f in name for f in freeze):
                p.requires_grad_(False)
    engine = initialize(zero_model, optimizer=optimizer, optimizer_kwargs=kwargs,
                        param_groups=_groups(zero_model, groups, wd),
                        config=ZeroConfig(stage=stage, bucket_mb=bucket_mb, grad_accum_steps=accum, grad_clip=clip,
                                          units=units, activation_checkpointing=activation_checkpointing,
                                          persistence_threshold=persistence_threshold,
                                          prefetch_bytes=prefetch_bytes, broadcast_buffers=broadcast_buffers,
                                          hierarchy=hierarchy))
    out = {k: 0.0 for k in ("loss", "grad_norm", "params", "buffers", "floor_loss", "floor_grad_norm",
                            "floor_params", "eval")}
    for step in range(steps):
        losses, norms = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        for micro in range(accum):
            batch = _batch(model, step, micro, rank, world_size, branch_pattern)
            for i, ddp in enumerate(ddps):
                sync = micro == accum - 1 or i == 1
                with (contextlib.nullcontext() if sync else ddp.no_sync()):
                    loss = _loss(ddp(batch))
                    (loss / accum).backward()
                losses[i] += loss.item() / accum
            zl = _loss(engine(batch))
            engine.backward(zl)
            losses[2] += zl.item() / accum
        for i, (m, opt) in enumerate(zip((ref_model, alt_model), opts)):
            # a parameter no rank used keeps grad None and is not stepped (Note [Unused parameters] in zero/masters.py)
            params = [p for p in m.parameters() if p.requires_grad and p.grad is not None]
            if i == 0:
                norms[i] = float(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf")))
            else:  # the same clipping, the norm summed in another (equally valid) order
                norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in params]))
                if clip:
                    torch._foreach_mul_([p.grad for p in params], torch.clamp(clip / (norm + 1e-6), max=1.0))
                norms[i] = float(norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        norms[2] = float(engine.step())
        out["loss"] = max(out["loss"], rel(losses[2], losses[0]))
        out["grad_norm"] = max(out["grad_norm"], rel(norms[2], norms[0]))
        out["floor_loss"] = max(out["floor_loss"], rel(losses[1], losses[0]))
        out["floor_grad_norm"] = max(out["floor_grad_norm"], rel(norms[1], norms[0]))
    # evaluation: eval mode under no_grad, on a batch of every rank
    ref_model.eval(), zero_model.eval()
    with torch.no_grad():
        batch = _batch(model, steps, 0, rank, world_size, "never")
        out["eval"] = rel(_loss(engine(batch)).item(), _loss(ref_model(batch)).item())
    ref_model.train(), zero_model.train()
    ref_state = ref_model.state_dict()
    for prefix, state in (("", engine.state_dict()), ("floor_", alt_model.state_dict())):
        assert list(state) == list(ref_state), (list(state), list(ref_state))
        for (name, a), b in zip(ref_state.items(), state.values()):
            key = "buffers" if name.endswith(("running_mean", "running_var", "num_batches_tracked")) else "params"
            if prefix == "floor_" and key == "buffers":
                continue
            out[prefix + key] = max(out[prefix + key], rel(b.float(), a.float()))
    out["last_loss"] = losses[0]
    return out


def memory(stage: int, model: str = "gpt", units: tuple = (), precision: str = "fp32",
           persistence_threshold: int = 0) -> dict:
    """The engine's reported model-state bytes after one step, with Ψ and the padded numel (``persistent``:
    of the stage-3 persistent parameters' buffers; ``kept``: of the units kept from forward to backward, gathered
    once a step instead of twice, Note [Kept from forward to backward] in zerorun/zero/stage3_outer.py, seen as
    they are held at the forward's end; ``kept_units``: their names)."""
    m = _build(model, 0)
    engine = initialize(m, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3},
                        config=ZeroConfig(stage=stage, bucket_mb=0.002, units=units, precision=precision,
                                          persistence_threshold=persistence_threshold))
    held = []
    for unit in getattr(engine, "units", []):
        unit.hold = functools.partial(lambda u, hold: (held.append(u), hold())[1], unit, unit.hold)
    engine.backward(_loss(engine(_batch(model, 0, 0, dist.get_rank(), dist.get_world_size(), "never"))))
    engine.step()
    return {"bytes": engine.memory_bytes(), "psi": engine.num_params,
            "padded": sum(b.numel for b in engine.buffers), "world_size": dist.get_world_size(),
            "comm": engine.comm_stats(),
            "persistent": sum(b.numel for b in getattr(engine, "_persistent_unit", None).buffers) if stage == 3 else 0,
            "kept": sum(b.numel for u in held for b in u.trainable), "kept_units": [u.name for u in held],
            "persistent_params": sorted(n for b in engine._persistent_unit.buffers for n in b.names)
            if stage == 3 else []}


def deferred_equals_normal(world_size_check: bool = True) -> dict:
    """Stage 3 from a meta-device model: the gathered parameters equal normal construction's, bit for bit,
    and the generator is left where normal construction leaves it."""
    torch.manual_seed(7)
    normal = _gpt_module().build_model(vocab_size=61, n_layer=3, n_head=2, d_model=18, max_seq_len=16)
    after_normal = torch.rand(4)
    torch.manual_seed(7)
    meta = deferred_init(_gpt_module().build_model, vocab_size=61, n_layer=3, n_head=2, d_model=18,
                         max_seq_len=16)
    assert all(p.is_meta for p in meta.parameters())
    engine = initialize(meta, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3},
                        config=ZeroConfig(stage=3, units=("Block",)))
    after_meta = torch.rand(4)
    full = engine.full_state_dict(rank0_only=False)
    ref = normal.state_dict()
    return {"keys": list(full) == list(ref), "equal": all(torch.equal(full[k], ref[k]) for k in ref),
            "rng": torch.equal(after_normal, after_meta), "units": [u.name for u in engine.units]}


def prefetch_order(prefetch_bytes: int | None = None, n_layer: int = 2, keep: int | None = None) -> dict:
    """Unit order recorded by stage 3 after two steps (Note [Prefetch]), whether the step-2 gathers were
    issued ahead of use (the all-gather of the next unit in flight when the current unit starts), and, for
    each all-gather of step 2 issued ahead of use, the unit in use then (``issued``: (unit, phase, in use)),
    and each block's gathered bytes. ``keep``: ``zero.keep_root_bytes`` (None: its default)."""
    model = _build("gpt", 0, n_layer=n_layer)
    extra = {} if keep is None else {"keep_root_bytes": keep}
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3},
                        config=ZeroConfig(stage=3, units=("Block",), prefetch_bytes=prefetch_bytes, **extra))
    ahead, issued = [], []

    def spy(unit, original, wait=True):
        # the unit's own turn (the schedule's hooks issue its all-gather, then the units ahead, then wait): was it
        # already being gathered when its turn came?
        own = sys._getframe(1).f_code.co_name in ("pre_forward", "pre_backward")
        if own and not wait:
            ahead.append((unit.name, unit.state.value))
        elif not own and not wait and unit.state.value == "free":
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            seen = engine.sched.seen[phase]
            issued.append((unit.name, phase, seen[-1].name if seen else None))
        original(wait)

    for unit in engine.units:  # every call of a unit's all-gather (Unit.unshard), whoever makes it
        unit.unshard = functools.partial(spy, unit, unit.unshard)
    for step in range(2):
        ahead.clear()
        issued.clear()
        engine.backward(_loss(engine(_batch("gpt", step, 0, dist.get_rank(), dist.get_world_size(), "never"))))
        engine.step()
    return {"forward": [u.name for u in engine.sched.order["forward"]],
            "backward": [u.name for u in engine.sched.order["backward"]],
            "states_at_use": ahead, "issued": issued,
            "block_bytes": [u.gathered_bytes for u in engine.units if u.name.startswith("blocks")]}


def paper_bytes(stage: int, padded: int, n: int, param_bytes: int, grad_bytes: int, optim_bytes: int):
    """ZeRO §5's split of model-state bytes per rank, ``(params, grads, optimizer)``, for ``padded`` elements on
    ``n`` ranks: stage 1 partitions the optimizer states, stage 2 also the gradients, stage 3 also the
    parameters (``*_bytes``: bytes per element of each kind, e.g. 4, 4, 8 for fp32 AdamW)."""
    p, g, o = param_bytes * padded, grad_bytes * padded, optim_bytes * padded
    return {0: (p, g, o), 1: (p, g, o // n), 2: (p, g // n, o // n), 3: (p // n, g // n, o // n)}[stage]


def root_left_empty(persistence_threshold: int) -> dict:
    """Stage 3 on the untied tiny GPT with units = Block and a threshold that makes every root parameter
    persistent: the forward order is still recorded (the root's hooks end the pass) and nothing piles up."""
    model = _build("gpt", 0, tie_embeddings=False)
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3},
                        config=ZeroConfig(stage=3, units=("Block",), persistence_threshold=persistence_threshold))
    for step in range(3):
        engine.backward(_loss(engine(_batch("gpt", step, 0, dist.get_rank(), dist.get_world_size(), "never"))))
        engine.step()
    root = next(u for u in engine.units if u.is_root)
    return {"root_buffers": len(root.buffers), "forward": [u.name for u in engine.sched.order["forward"]],
            "seen": len(engine.sched.seen["forward"]), "persistent": len(engine._persistent_unit.buffers)}
