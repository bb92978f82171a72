"""Which optimizers may run over ZeRO's flat slices.

Note [Elementwise optimizers]: the engine builds the user's optimizer over one 1-D fp32 master per flat buffer
(this rank's slice; the whole buffer at stage 0; sub-groups of it with disk offload), and a flat buffer holds
several parameters, cut anywhere by the rank boundaries (Note [Flat buffer layout] in ``flat.py``). That gives
the same numbers as stepping each parameter on its own only when the update of each element depends on that
element's own parameter, gradient and state, and on scalars that are the same for every tensor of a param
group (lr, betas, the step count). Optimizers that compute anything per tensor break this silently: a trust
ratio ``||w|| / ||g||`` (LARS, LAMB), a factored second moment over rows and columns (Adafactor), a
preconditioner or orthogonalization of the matrix (Shampoo, Muon), a line search over the whole model (LBFGS).

So the engine accepts, without being told, exactly the ``torch.optim`` classes in
:data:`ELEMENTWISE_OPTIMIZERS`, each checked against its algorithm in torch's documentation, with every option
(momentum, nesterov, amsgrad, centered, maximize, decoupled weight decay, foreach/fused): SGD, Adam, AdamW,
Adagrad (dense gradients), Adamax, NAdam (its ``mu_product`` is a per-tensor scalar that depends on the step
only), RAdam (``rho_t`` likewise), RMSprop, Rprop (per-element step sizes from the signs of consecutive
gradients), ASGD (``eta`` and ``mu`` depend on the step only) and Adadelta. The check is on the exact class,
not ``issubclass``: a subclass may override ``step`` with per-tensor math. Any other class (a subclass, a
user's optimizer, a ``torch.optim`` class added later) runs only when the caller declares it elementwise
(``train.optimizer.elementwise: true`` in a recipe, ``initialize(..., elementwise=True)`` in code); the classes in
:data:`NON_ELEMENTWISE_OPTIMIZERS` are known not to be and are refused even when declared.
"""

from __future__ import annotations

import typing
from typing import Any

import torch

#: ``torch.optim`` classes whose update is elementwise (Note [Elementwise optimizers]); exact classes only.
ELEMENTWISE_OPTIMIZERS: frozenset[type] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
    torch.optim.Adadelta,
})

#: ``torch.optim`` class names known not to be elementwise, with the reason; refused even when declared.
NON_ELEMENTWISE_OPTIMIZERS: dict[str, str] = {
    "LBFGS": "a line search over all parameters at once, with a closure",
    "SparseAdam": "sparse gradients only",
    "Adafactor": "a second moment factored over each matrix's rows and columns",
    "Muon": "an orthogonalization of each whole matrix",
}

#: How a caller declares an optimizer elementwise, named in every refusal.
WAY_OUT = "train.optimizer.elementwise: true in the recipe, or initialize(..., elementwise=True)"


def optimizer_class(optimizer: str | type) -> type:
    """The ``torch.optim`` class named ``optimizer`` (e.g. ``"AdamW"``), or ``optimizer`` itself when it is a
    ``torch.optim.Optimizer`` subclass. No elementwise check (see :func:`resolve_optimizer`).

    Raises:
        ValueError: not a class of ``torch.optim``, or not an optimizer class.
    """
    if isinstance(optimizer, str):
        cls = getattr(torch.optim, optimizer, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            import difflib

            names = [n for n, c in vars(torch.optim).items() if isinstance(c, type)
                     and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer]
            lower = {n.lower(): n for n in names}  # 'adamw' was told 'Adam', 'sgd' nothing (a new user's review)
            near = [lower[m] for m in difflib.get_close_matches(optimizer.lower(), lower, n=1)]
            raise ValueError(f"unknown optimizer {optimizer!r}: not a class in torch.optim"
                             + (f" (did you mean {near[0]!r}?)" if near else ""))
        return cls
    if isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed's initialize(optimizer=opt) habit
        raise ValueError(f"optimizer: got an instance of {type(optimizer).__name__}; the engine makes the optimizer "
                         "over its flat slices: pass its class or name and its options, e.g. optimizer="
                         f"{type(optimizer).__name__!r}, optimizer_kwargs={{'lr': ...}} (or param_groups)")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ValueError(f"optimizer {optimizer!r:.80} is not a torch.optim.Optimizer class")
    return optimizer


def _qualname(cls: type) -> str:
    return cls.__name__ if cls.__module__.startswith("torch.optim") else f"{cls.__module__}.{cls.__qualname__}"


def resolve_optimizer(optimizer: str | type, *, elementwise: bool = False) -> type:
    """The optimizer class for ZeRO's flat slices (Note [Elementwise optimizers]): ``optimizer`` is a
    ``torch.optim`` class name or a ``torch.optim.Optimizer`` subclass.

    Args:
        elementwise: the caller declares that the class's update of each element depends only on that
            element (and on per-group scalars); needed for any class outside :data:`ELEMENTWISE_OPTIMIZERS`.

    Raises:
        ValueError: unknown name or not an optimizer class; a class known not to be elementwise
            (:data:`NON_ELEMENTWISE_OPTIMIZERS`, declared or not); any other class outside
            :data:`ELEMENTWISE_OPTIMIZERS` that is not declared elementwise (one line naming the class and
            :data:`WAY_OUT`).
    """
    cls = optimizer_class(optimizer)
    if cls in ELEMENTWISE_OPTIMIZERS:
        return cls
    name = _qualname(cls)
    known = NON_ELEMENTWISE_OPTIMIZERS.get(cls.__name__) if cls.__module__.startswith("torch.optim") else None
    if known:
        raise ValueError(f"optimizer {name} is not elementwise ({known}): ZeRO's flat partitions need an optimizer "
                         "whose update of one element depends only on that element (Adam, AdamW, SGD, ...)")
    if not elementwise:
        base = next((b for b in cls.__mro__[1:] if b in ELEMENTWISE_OPTIMIZERS), None)
        kind = (f"a subclass of {_qualname(base)}" if base is not None else
                "a torch.optim class zerorun has not checked" if cls.__module__.startswith("torch.optim")
                else "not a torch.optim class")
        raise ValueError(f"optimizer {name} ({kind}) is not known to be elementwise: ZeRO steps it over flat slices "
                         "that span several parameters, which silently changes any per-tensor math (trust "
                         "ratios, norms, factored or matrix states); if its update of each element depends only "
                         f"on that element, declare it with {WAY_OUT}")
    return cls


def _optional_bool(annotation: Any) -> bool:
    """Whether a parameter's annotation is ``bool | None`` (``Optional[bool]``), as an object or as text."""
    if isinstance(annotation, str):
        return annotation.replace(" ", "") in ("bool|None", "None|bool", "Optional[bool]", "typing.Optional[bool]")
    return set(typing.get_args(annotation)) == {bool, type(None)}


def accepts(cls: type, name: str) -> bool:
    """Whether optimizer class ``cls`` takes a keyword argument ``name`` (or any, through ``**kwargs``)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_arguments(cls: type, kwargs: dict) -> None:
    """Every key of ``kwargs`` is an argument of optimizer class ``cls``, a boolean is not given where the
    argument is a number (YAML's ``yes`` for ``lr``), nor text (``eps: "0x10"``), an argument whose default is
    a boolean (or ``None`` with a ``bool | None`` annotation: ``foreach``) gets ``true``/``false`` (or null) and
    nothing else (``maximize: "false"``, ``[false]`` or ``2`` would turn it on), and ``cls`` accepts the values
    (built once on a 2-element probe parameter, which takes one step: its own checks, e.g. ``lr >= 0``, and what
    only its step finds, e.g. ``betas`` of three numbers).

    Raises:
        ValueError: ``(key, message)`` for the first key that fails (``key`` None: the values together).
    """
    import inspect
    import json
    import re

    accepted = inspect.signature(cls.__init__).parameters
    for key, value in kwargs.items():
        if key not in accepted:
            raise ValueError(key, f"{cls.__name__} has no argument {key!r}")
        default = accepted[key].default
        numeric = isinstance(default, (int, float, tuple)) and not isinstance(default, bool)
        values = value if isinstance(value, (list, tuple)) else [value]
        if numeric and any(isinstance(v, bool) for v in values):
            raise ValueError(key, f"expected a number, got a boolean ({json.dumps(value)})")
        if numeric and any(isinstance(v, str) for v in values):  # "1e-8" fails inside step()
            raise ValueError(key, f"expected a number, got text ({json.dumps(value)})")
        optional = default is None and _optional_bool(accepted[key].annotation)  # foreach, fused: bool | None
        if (isinstance(default, bool) or optional) and not (isinstance(value, bool) or optional and value is None):
            # any other value is read for its truth: "false", [false] and 2 all turn the option on
            raise ValueError(key, f"expected true or false{' or null' if optional else ''}, got {json.dumps(value)}")
    import torch

    stepped = False
    try:  # the values too (betas of one number, a negative lr): the class's own checks, on a 2-element probe,
        probe = torch.nn.Parameter(torch.zeros(2))  # and one step of it: betas of three numbers passed the
        optimizer = cls([probe], **kwargs)  # constructor and failed every rank's first step
        probe.grad = torch.zeros(2)
        if not kwargs.get("capturable"):  # capturable steps only on an accelerator's tensors, not the CPU probe
            stepped = True
            optimizer.step()
    except Exception as e:  # noqa: BLE001 - whatever the class raises is the user's one-line answer
        # the argument the message names at a word's start ("epsilon" is eps; "state_steps" named eps too)
        key = next((k for k in kwargs if re.search(rf"\b{re.escape(k)}", str(e))), None)
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(key, f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) refused "
                         f"these values{' at its first step' if stepped else ''}: {type(e).__name__}: "
                         f"{detail}") from None


def default_param_groups(model: torch.nn.Module, weight_decay: float, decay_1d: bool = False) -> list[dict[str, Any]]:
    """Two torch-style param groups over the trainable parameters of ``model``: tensors with 2 or more
    dimensions (matrices, embeddings) get ``weight_decay``; 1-D tensors (biases, norm weights) get 0 unless
    ``decay_1d`` (the GPT-2/nanoGPT convention). Empty groups are dropped."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 or decay_1d else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
