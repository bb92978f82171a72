"""In-place writes to parameters between two steps (Note [Writes between steps] in zerorun/zero/param_writes.py),
run on spawned gloo ranks by test_param_writes.py."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from zerorun.zero import ZeroConfig, initialize


class Net(nn.Module):
    """Two layers; with ``clamp``, ``forward`` clamps ``b.weight`` in place under ``no_grad`` first (a constraint
    applied alike on every rank: it reads no data)."""

    def __init__(self, clamp: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
        self.clamp = clamp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clamp:
            with torch.no_grad():
                self.b.weight.clamp_(-0.3, 0.3)
        return self.b(torch.tanh(self.a(x))).square().mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _write(model: nn.Module) -> None:
    """The user's writes after a step, alike on every rank: WGAN's clipping of ``a.weight`` and a re-init."""
    with torch.no_grad():
        model.a.weight.clamp_(-0.05, 0.05)
        nn.init.constant_(model.b.bias, 0.1)


def against_plain_pytorch(stage: int, offload: str = "none", steps: int = 4) -> dict:
    """Train ``Net`` (SGD with momentum) with :func:`_write` after every step, beside plain PyTorch on every rank's
    batch with the same writes (DDP's numbers): the largest relative difference of the losses and of the final
    parameters."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    with tempfile.TemporaryDirectory() as tmp:
        engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
                            config=ZeroConfig(stage=stage, offload_optimizer=offload, offload_path=tmp))
        _write(model)
        _write(ref)
        rel = 0.0
        for step in range(steps):
            loss = engine(_batch(step, dist.get_rank()))
            engine.backward(loss)
            engine.step()
            _write(model)
            ref_opt.zero_grad()
            with torch.no_grad():
                want = float(ref(_batch(step, dist.get_rank())))
            ref(torch.cat([_batch(step, r) for r in range(dist.get_world_size())])).backward()  # the ranks' mean
            ref_opt.step()
            _write(ref)
            rel = max(rel, abs(float(loss) - want) / abs(want))
        got = engine.full_state_dict(rank0_only=False)
        params = max(float((got[k] - v).abs().max() / v.abs().max()) for k, v in ref.state_dict().items())
        engine.close()
    return {"loss": rel, "params": params}


def kept_in_mixed_precision(stage: int, precision: str, offload: str = "none", steps: int = 3) -> bool:
    """With a step that changes nothing (SGD, lr 0), ``a.weight`` halved in place after every step: whether the
    parameter after ``steps`` steps equals its first value (in ``precision``) times 0.5**steps, bit for bit
    (halving is exact in bf16 and fp16): each write kept by the fp32 masters, none undone by a step."""
    torch.manual_seed(0)
    model = Net()
    with tempfile.TemporaryDirectory() as tmp:
        engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.0},
                            config=ZeroConfig(stage=stage, precision=precision, offload_optimizer=offload,
                                              offload_path=tmp))
        first = model.a.weight.detach().clone()
        for step in range(steps):
            engine.backward(engine(_batch(step, dist.get_rank())))
            engine.step()
            with torch.no_grad():
                model.a.weight.mul_(0.5)
        engine.backward(engine(_batch(steps, dist.get_rank())))  # the last write goes through one more step
        engine.step()
        kept = torch.equal(model.a.weight.detach(), first * 0.5 ** steps)
        engine.close()
    return kept


class Looked(nn.Module):
    """An embedding with ``max_norm``: its forward renorms, in place, the rows the batch looks up."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)
        self.emb = nn.Embedding(16, 4, max_norm=1.0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx)).square().mean()


def differing_by_rank(stage: int, steps: int = 3, accum: int = 1) -> dict:
    """Train :class:`Looked` where each rank looks up other rows (its writes differ by rank), beside DDP: the
    first error's text (``None``: none) and, without one, the largest relative difference of the losses from
    DDP's on this rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Looked()
    ddp = DDP(copy.deepcopy(model))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=stage, grad_accum_steps=accum))
    rel = 0.0
    try:
        for step in range(steps):
            for micro in range(accum):
                g = torch.Generator().manual_seed(10 * step + micro + 100 * dist.get_rank())
                idx = torch.randint(0, 16, (6,), generator=g)
                loss = engine(idx)
                engine.backward(loss)
                with ddp.no_sync() if micro + 1 < accum else contextlib.nullcontext():
                    want = ddp(idx)
                    (want / accum).backward()
                rel = max(rel, abs(float(loss) - float(want)) / abs(float(want)))
            engine.step()
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        return {"error": str(e), "rel": rel}
    return {"error": None, "rel": rel}


def saved_after_a_write(root: str, stage: int, precision: str, offload: str = "none") -> bool:
    """One step, then ``a.weight`` halved in place and a checkpoint saved: whether a fresh engine (another seed)
    that loads it holds the written values, bit for bit (in ``precision``)."""
    from zerorun import checkpoint

    def build(seed: int):
        torch.manual_seed(seed)
        model = Net()
        return model, initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                                 config=ZeroConfig(stage=stage, precision=precision, offload_optimizer=offload,
                                                   offload_path=os.path.join(root, f"swap{seed}")))
    model, engine = build(0)
    engine.backward(engine(_batch(0, dist.get_rank())))
    engine.step()
    with torch.no_grad():
        model.a.weight.mul_(0.5)
    written = model.a.weight.detach().clone()
    path, _, _ = checkpoint.save(engine, root, 1)
    engine.close()
    model, engine = build(1)
    checkpoint.load(path, engine)
    kept = torch.equal(model.a.weight.detach(), written)
    engine.close()
    return kept


def persistent_write_at_stage_3() -> str:
    """Stage 3 with the head's bias persistent (``zero.persistence_threshold``), written in place after a step
    outside ``gathered_parameters``: the error of the next forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1},
                        config=ZeroConfig(stage=3, persistence_threshold=4))
    engine.backward(engine(_batch(0, dist.get_rank())).square().mean())
    engine.step()
    with torch.no_grad():
        model[2].bias.add_(1.0)
    try:
        engine(_batch(1, dist.get_rank()))
    except RuntimeError as e:
        return str(e)
    return "no error"


def written_before_a_block(stage: int, precision: str, offload: str = "none", block: str = "b.bias",
                           write: bool = True) -> dict:
    """``a.weight`` halved in place on every rank, then a ``gathered_parameters(modifier_rank=0)`` block over
    ``block`` (``write``: rank 0 adds 1 to it there), then a step that changes nothing (SGD, lr 0): whether
    ``a.weight`` is its first value (in ``precision``) halved, bit for bit, and the error raised (``None``). No
    write in the forward (it would take the earlier write with its own)."""
    torch.manual_seed(0)
    model = Net(clamp=False)
    with tempfile.TemporaryDirectory() as tmp:
        engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.0},
                            config=ZeroConfig(stage=stage, precision=precision, offload_optimizer=offload,
                                              offload_path=tmp))
        first = model.a.weight.detach().clone()
        param = model.get_parameter(block)
        error = None
        try:
            with torch.no_grad():
                model.a.weight.mul_(0.5)
                with engine.gathered_parameters([param], modifier_rank=0):
                    if write and dist.get_rank() == 0:
                        param.add_(1.0)
            engine.backward(engine(_batch(0, dist.get_rank())))
            engine.step()
        except RuntimeError as e:
            error = str(e)
        kept = torch.equal(model.a.weight.detach(), first * 0.5)
        engine.close()
    return {"kept": kept, "error": error}


def data_read_at_stage_3() -> str:
    """Stage 3, ``a.weight.data`` read between steps (WGAN's ``p.data.clamp_(...)``): the error."""
    torch.manual_seed(0)
    model = Net(clamp=False)
    initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1}, config=ZeroConfig(stage=3))
    try:
        model.a.weight.data.clamp_(-0.01, 0.01)
    except RuntimeError as e:
        return str(e)
    return "no error"


def direct_call_at_stage_3(units: tuple) -> dict:
    """Stage 3, ``b`` called directly under ``no_grad`` (as a generation loop calls an LM head): the error, or
    whether the output equals the plain layer's from ``full_state_dict`` (``b`` named in ``units``)."""
    torch.manual_seed(0)
    model = Net(clamp=False)
    plain = copy.deepcopy(model)
    engine = initialize(model, optimizer="SGD", optimizer_kwargs={"lr": 0.1}, config=ZeroConfig(stage=3, units=units))
    h = torch.randn(4, 8)
    try:
        with torch.no_grad():
            out = model.b(h)
    except RuntimeError as e:
        return {"error": str(e)}
    plain.load_state_dict(engine.full_state_dict(rank0_only=False))
    return {"error": None, "same": torch.equal(out, plain.b(h).detach())}
