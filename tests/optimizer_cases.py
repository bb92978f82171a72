"""Cases run on every rank of a :class:`distributed.RankPool`: which optimizers the engine accepts, and that
each accepted one trains as it does per parameter (Note [Elementwise optimizers] in zero/optimizers.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerorun.zero import ZeroConfig, default_param_groups, initialize
from parity_cases import _batch, _build, _loss, rel

#: every class of zero.optimizers.ELEMENTWISE_OPTIMIZERS, with options that exercise its per-element state
ALLOWED = [
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("Adam", {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.01}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}),
    ("Adagrad", {"lr": 0.05, "lr_decay": 0.01}),
    ("Adamax", {"lr": 1e-2}),
    ("NAdam", {"lr": 1e-2, "weight_decay": 0.01, "decoupled_weight_decay": True}),
    ("RAdam", {"lr": 1e-2}),  # 7 steps: rho_t > 5 from step 6, its adaptive branch runs too
    ("RMSprop", {"lr": 1e-3, "momentum": 0.5, "centered": True}),
    ("Rprop", {"lr": 1e-3}),
    ("ASGD", {"lr": 1e-2, "t0": 2}),
    ("Adadelta", {"lr": 1.0, "weight_decay": 0.01}),
]


class TrustRatio(torch.optim.Optimizer):
    """SGD scaled per tensor by ||w|| / ||g|| (LARS without momentum, You et al. 2017): not elementwise."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * float(p.norm() / (p.grad.norm() + 1e-12)))


class PlainSGD(torch.optim.Optimizer):
    """A user's own elementwise optimizer: p -= lr * g."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class RenamedAdamW(torch.optim.AdamW):
    """A subclass of an allowed class: it could override ``step`` with per-tensor math."""


def _train(optimizer, kwargs: dict, stage: int | None, steps: int, elementwise: bool = False) -> list[torch.Tensor]:
    """Train the odd-sized MLP ``steps`` steps on this rank's batches; return its final parameters.
    ``stage=None``: the reference, a per-parameter optimizer over gradients all-reduced (mean) per parameter."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs = dict(kwargs)
    wd = kwargs.pop("weight_decay", 0.0)
    model = _build("mlp", 0)
    if stage is None:
        opt = (getattr(torch.optim, optimizer) if isinstance(optimizer, str) else optimizer)(
            default_param_groups(model, wd), **kwargs)
        for step in range(steps):
            model(_batch("mlp", step, 0, rank, world, "never")).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            opt.step()
            opt.zero_grad(set_to_none=False)
        return [p.detach().clone() for p in model.parameters()]
    engine = initialize(model, optimizer=optimizer, optimizer_kwargs=kwargs,
                        param_groups=default_param_groups(model, wd), config=ZeroConfig(stage=stage, bucket_mb=0.002),
                        elementwise=elementwise)
    for step in range(steps):  # 2 KiB buckets: slices cut parameters and span several of them
        engine.backward(engine(_batch("mlp", step, 0, rank, world, "never")))
        engine.step()
    out = [p.detach().clone() for p in model.parameters()]
    engine.close()
    return out


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(rel(x, y) for x, y in zip(a, b))


def allowed_equal_per_parameter(steps: int = 7) -> dict:
    """Every allowed class, and a user's elementwise class declared so, at stages 0 and 2 against the
    per-parameter reference: ``{name: (stage-0 distance, stage-2 distance)}`` (max relative difference of the
    final parameters)."""
    out = {}
    for name, kwargs in ALLOWED + [(PlainSGD, {"lr": 0.1})]:
        declared = not isinstance(name, str)
        ref = _train(name, kwargs, None, steps)
        key = name if isinstance(name, str) else name.__name__
        out[key] = tuple(_distance(_train(name, kwargs, s, steps, elementwise=declared), ref) for s in (0, 2))
    return out


def refusals() -> dict:
    """What ``initialize`` says for a trust-ratio optimizer and a subclass of AdamW, undeclared; and how far the
    trust-ratio one ends from its per-parameter reference when (wrongly) declared elementwise."""
    out = {}
    for cls in (TrustRatio, RenamedAdamW):
        try:
            _train(cls, {"lr": 0.01}, 2, 1)
            out[cls.__name__] = None
        except ValueError as e:
            out[cls.__name__] = str(e)
    out["declared_renamed_adamw"] = _distance(_train(RenamedAdamW, {"lr": 1e-2}, 2, 3, elementwise=True),
                                              _train(RenamedAdamW, {"lr": 1e-2}, None, 3))
    return out


def tensor_lr(stage: int, steps: int = 3) -> float:
    """Adam with ``lr`` a tensor (torch's CPU default path takes it) against the same ``lr`` as a float: the largest
    relative difference of the losses (the engine chose ``foreach=True`` itself, which torch refuses with a tensor
    ``lr``: found by review)."""
    out = []
    for lr in (torch.tensor(1e-2), 1e-2):
        model = _build("mlp", 0)
        engine = initialize(model, optimizer="Adam", optimizer_kwargs={"lr": lr},
                            param_groups=[{"params": list(model.parameters())}], config=ZeroConfig(stage=stage))
        losses = []
        for step in range(steps):
            loss = _loss(engine(_batch("mlp", step, 0, dist.get_rank(), dist.get_world_size(), "always")))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        out.append(losses)
    return max(rel(a, b) for a, b in zip(*out))
