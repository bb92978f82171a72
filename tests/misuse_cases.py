"""Engine misuse that raises (run on spawned gloo ranks by test_misuse.py): the error comes before any
collective, on every rank, and the same processes then train on, equal to DDP."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from collective_devices import COLLECTIVES  # every Comm method that issues a collective
from zerorun.zero import ZeroConfig, initialize
from zerorun.zero.comm import Comm


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).square().mean()


def _x(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + dist.get_rank())
    return torch.randn(4, 8, generator=g)


def _error(call) -> tuple[str, int]:
    """The RuntimeError or ValueError ``call`` raises and how many collectives the engine issued before
    raising."""
    issued = []
    saved = {name: getattr(Comm, name) for name in COLLECTIVES}
    for name, fn in saved.items():
        setattr(Comm, name, lambda self, *a, _fn=fn, _name=name, **k: issued.append(_name) or _fn(self, *a, **k))
    try:
        call()
    except (RuntimeError, ValueError) as e:
        return str(e), len(issued)
    finally:
        for name, fn in saved.items():
            setattr(Comm, name, fn)
    return "no error", len(issued)


def misuse(stage: int, kind: str, units: tuple = ()) -> dict:
    """``kind``: ``"double_backward"`` (grad_accum_steps 1: a second backward before step) or ``"early_step"``
    (grad_accum_steps 4: step after 2 micro-steps). After the error the loop goes on correctly (the step, or
    the remaining micro-steps and the step) and trains one more step; returns the error and the largest
    relative difference of the parameters from DDP's, which never saw the bad call."""
    accum = 1 if kind == "double_backward" else 4
    torch.manual_seed(0)
    model = Net()
    ref = DDP(copy.deepcopy(model))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
                        param_groups=[{"params": list(model.parameters())}],
                        config=ZeroConfig(stage=stage, grad_accum_steps=accum, units=units))
    for step in range(2):
        for micro in range(accum):
            with ref.no_sync() if micro + 1 < accum else torch.enable_grad():
                (ref(_x(step, micro)) / accum).backward()
        ropt.step()
        ropt.zero_grad()
    errors = []
    if kind == "double_backward":
        engine.backward(engine(_x(0, 0)))
        loss = engine(_x(0, 1))  # a forward too many is no misuse; its backward is
        errors.append(_error(lambda: engine.backward(loss)))
    else:
        for micro in range(2):
            engine.backward(engine(_x(0, micro)))
        errors.append(_error(engine.step))
        for micro in range(2, 4):
            engine.backward(engine(_x(0, micro)))
    engine.step()
    for micro in range(accum):
        engine.backward(engine(_x(1, micro)))
    engine.step()
    sd = engine.full_state_dict(rank0_only=False)
    worst = max(float((sd[k] - v).abs().max() / v.abs().max()) for k, v in ref.module.state_dict().items())
    return {"errors": errors, "rel": worst}


def second_engine(stage: int, first_stage: int = 3, close: bool = False) -> dict:
    """An engine at ``first_stage`` trains one step (and is closed, with ``close``); then a second engine at
    ``stage`` is asked for over the same model, whose parameters the first one holds (partitioned, or with its
    gradient hooks): the error, the collectives issued before it, and whether the first engine still trains."""
    torch.manual_seed(0)
    model = Net()
    first = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2}, config=ZeroConfig(stage=first_stage))
    first.backward(first(_x(0, 0)))
    first.step()
    if close:
        first.close()
    error = _error(lambda: initialize(model, optimizer="AdamW", config=ZeroConfig(stage=stage)))
    if close:
        return {"error": error, "norm": 1.0}
    first.backward(first(_x(1, 0)))
    return {"error": error, "norm": float(first.step())}


def backward_outside(stage: int, units: tuple, how: str) -> list[str]:
    """Note [One backward per micro-step]: a backward over the engine's output run around ``engine.backward``
    (``how``: ``"tensor"``, an auxiliary loss's ``.backward(retain_graph=True)``; ``"autograd"``,
    ``torch.autograd.backward``; ``"into_a_parameter"``, ``torch.autograd.backward(..., inputs=[a parameter])``;
    ``"before_step"``, a plain ``loss.backward()`` where ``engine.backward`` belongs). Returns the error raised and
    the collectives issued before it, then the same of ``torch.autograd.grad`` on the input (no error: it reaches
    no parameter's gradient)."""
    torch.manual_seed(0)
    engine = initialize(Net(), optimizer="AdamW", config=ZeroConfig(stage=stage, units=units))
    x = _x(0, 0).requires_grad_()
    loss = engine(x)
    calls = {"tensor": lambda: (loss * 2).backward(retain_graph=True),
             "autograd": lambda: torch.autograd.backward([loss * 2], retain_graph=True),
             "into_a_parameter": lambda: torch.autograd.backward([loss * 2], inputs=[engine.module.a.weight],
                                                                 retain_graph=True),
             "before_step": lambda: loss.backward(retain_graph=True)}
    return [_error(calls[how]), _error(lambda: torch.autograd.grad(engine(x), x))]


def closed_engine(stage: int, tmp: str) -> list[tuple[str, int]]:
    """An engine (the optimizer on disk: a swap file and a reader thread) trains a step and is closed; then a
    forward, a backward and a step: each one's error and the collectives issued before it (before the fix:
    forward and backward ran on, and the step failed inside a thread pool: "cannot schedule new futures after
    shutdown")."""
    torch.manual_seed(0)
    engine = initialize(Net(), optimizer="AdamW", config=ZeroConfig(stage=stage, offload_optimizer="disk",
                                                                    offload_path=f"{tmp}/rank{dist.get_rank()}"))
    loss = engine(_x(0, 0))
    engine.backward(loss)
    engine.step()
    engine.close()
    return [_error(lambda: engine(_x(1, 0))), _error(lambda: engine.backward(loss)), _error(engine.step)]


def loss_not_scalar(stage: int) -> tuple[str, int]:
    """``engine.backward`` of a loss of 4 elements: the error and the collectives issued before it."""
    torch.manual_seed(0)
    engine = initialize(Net(), optimizer="AdamW", config=ZeroConfig(stage=stage))
    loss = engine(_x(0, 0)).repeat(4)
    return _error(lambda: engine.backward(loss))


def hook_returns_a_value(stage: int) -> str:
    """A post-accumulate hook registered after ``initialize`` that returns the gradient (``p.grad.mul_`` does):
    the error ``engine.backward`` raises."""
    torch.manual_seed(0)
    model = Net()
    engine = initialize(model, optimizer="AdamW", config=ZeroConfig(stage=stage))
    model.b.weight.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(0.5))
    try:
        engine.backward(engine(_x(0, 0)))
    except RuntimeError as e:
        return str(e)
    return "no error"


class _Raises(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` (a check in a custom autograd function)."""

    armed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if _Raises.armed:
            raise ValueError("a check in backward failed")
        return grad


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Deep(nn.Module):
    """Three blocks and a head (an outer unit at stage 3); the backward raises between blocks 1 and 2."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.head = nn.ModuleList(Block() for _ in range(3)), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = _Raises.apply(block(x)) if i == 1 else block(x)
        return self.head(x).square().mean()


def _deep_and_reference(stage: int, accum: int):
    """``Deep`` under an engine of ``stage`` (units ``Block`` at stage 3), AdamW lr 1e-2, and a copy for plain
    PyTorch with its optimizer: ``(engine, ref, ropt)``."""
    torch.manual_seed(0)
    model = Deep()
    ref = copy.deepcopy(model)
    engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},
                        param_groups=[{"params": list(model.parameters())}],
                        config=ZeroConfig(stage=stage, grad_accum_steps=accum, units=("Block",) if stage == 3 else ()))
    return engine, ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)


def _averaged_step(ref: nn.Module, ropt) -> None:
    """Plain PyTorch's step on the gradients averaged over the ranks (DDP's numbers)."""
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    ropt.step()
    ropt.zero_grad()


def _rel(engine, ref: nn.Module) -> float:
    """The largest relative difference of the engine's parameters from ``ref``'s."""
    sd = engine.full_state_dict(rank0_only=False)
    return max(float((sd[k] - v).abs().max() / v.abs().max()) for k, v in ref.state_dict().items())


def backward_that_raised(stage: int, accum: int, fail_step: int, fail_micro: int, how: str) -> dict:
    """Note [A backward that raised]: 4 steps of ``Deep``; at ``fail_step``/``fail_micro`` the backward raises on
    every rank midway (``how``: ``"function"``, a custom autograd function's; ``"outside"``, an auxiliary loss's
    ``.backward()`` outside ``engine.backward``). Then a backward and a step (each one's error and the collectives
    issued before it), ``engine.zero_grad()``, and the next step; ``zero_grad()`` also opens every step (nothing to
    drop). Returns the errors and the largest relative difference of the parameters from plain PyTorch's (gradients
    averaged over the ranks) that skipped the failed step."""
    engine, ref, ropt = _deep_and_reference(stage, accum)
    errors = []
    for step in range(4):
        engine.zero_grad(set_to_none=False)  # torch's argument is taken
        for micro in range(accum):
            if (step, micro) == (fail_step, fail_micro):
                _Raises.armed = how == "function"
                try:
                    loss = engine(_x(step, micro))
                    if how == "outside":
                        (loss * 2).backward(retain_graph=True)
                    engine.backward(loss)
                except (ValueError, RuntimeError) as e:
                    errors.append(str(e))
                finally:
                    _Raises.armed = False
                loss = engine(_x(step, micro))  # a forward is not refused
                errors += [_error(lambda: engine.backward(loss)), _error(engine.step)]
                engine.zero_grad()
                break
            engine.backward(engine(_x(step, micro)))
        else:
            engine.step()
            for micro in range(accum):
                (ref(_x(step, micro)) / accum).backward()
            _averaged_step(ref, ropt)
    return {"errors": errors, "rel": _rel(engine, ref)}


def zero_grad_on_one_rank(stage: int) -> dict:
    """Note [A backward that raised]: rank 0 alone calls ``engine.zero_grad()`` after the first of two micro-steps
    (stages 0-1 issue no collective before the last), then every rank runs the step: the error each rank raises at
    the end of the last backward, the error the step then raises, and, after ``zero_grad()`` on every rank and one
    more step, the largest relative difference from plain PyTorch that trained that one step."""
    engine, ref, ropt = _deep_and_reference(stage, 2)
    engine.backward(engine(_x(0, 0)))
    if dist.get_rank() == 0:
        engine.zero_grad()
        engine.backward(engine(_x(0, 0)))
    loss = engine(_x(0, 1))
    errors = [_error(lambda: engine.backward(loss)), _error(engine.step)]
    engine.zero_grad()
    for micro in range(2):
        engine.backward(engine(_x(1, micro)))
        (ref(_x(1, micro)) / 2).backward()
    engine.step()
    _averaged_step(ref, ropt)
    return {"errors": errors, "rel": _rel(engine, ref)}


def optimizer_habits(stage: int, kind: str) -> dict:
    """Note [The engine's optimizer]: after one step, ``kind``: ``add_group`` (``engine.optimizer.add_param_group``
    over ``b``'s parameters), ``rank0_state`` (every rank loads rank 0's ``engine.optimizer.state_dict()``),
    ``plain_state`` (a plain torch AdamW's state over the model's parameters), ``own_state`` (each rank its own
    state into a fresh engine, with the model's values). Returns the error (``None``) and, for ``own_state``, the
    largest relative difference of two more steps' losses from the uninterrupted engine's."""
    torch.manual_seed(0)
    model = Net()
    fresh = copy.deepcopy(model)
    make = lambda m: initialize(m, optimizer="AdamW", optimizer_kwargs={"lr": 1e-2},  # noqa: E731
                                config=ZeroConfig(stage=stage, bucket_mb=2**-10))
    engine = make(model)
    engine.backward(engine(_x(0, 0)))
    engine.step()
    try:
        if kind == "add_group":
            engine.optimizer.add_param_group({"params": list(model.b.parameters()), "lr": 0.1})
        elif kind == "rank0_state":
            box = [engine.optimizer.state_dict()]
            dist.broadcast_object_list(box, src=0)
            engine.optimizer.load_state_dict(box[0])
        elif kind == "plain_state":
            plain = torch.optim.AdamW(fresh.parameters())
            engine.optimizer.load_state_dict(plain.state_dict())
        else:
            other = make(fresh)
            other.optimizer.load_state_dict(copy.deepcopy(engine.optimizer.state_dict()))
            with torch.no_grad():
                for p, q in zip(fresh.parameters(), model.parameters()):
                    p.copy_(q)
            rel = 0.0
            for step in (1, 2):
                losses = []
                for e in (engine, other):
                    loss = e(_x(step, 0))
                    e.backward(loss)
                    e.step()
                    losses.append(float(loss))
                rel = max(rel, abs(losses[1] - losses[0]) / abs(losses[0]))
            return {"error": None, "rel": rel}
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": None}


def meta_model(stage: int) -> tuple[str, int]:
    """A model built under ``torch.device("meta")`` (not ``deferred_init``) given to ``initialize``: the error and
    the collectives issued before it (before: an engine whose forward raised torch's "Tensor on device meta")."""
    with torch.device("meta"):
        model = Net()
    return _error(lambda: initialize(model, optimizer="AdamW", config=ZeroConfig(stage=stage)))
