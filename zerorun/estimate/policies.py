"""Precision and optimizer policies of ``zerorun estimate``: bytes per element of what a rank holds."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from zerorun.errors import ZerorunError


# -------------------------------------------------------------------------------------- policies
@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a rank holds (ZeRO paper §5; Note [Mixed precision] in ``zero/precision.py``).

    Attributes:
        name: ``precision`` (fp32, bf16, fp16): the dtype the engine casts the model to before packing it.
        param_bytes: the parameters the model computes with (fp32 4, bf16/fp16 2).
        grad_bytes: their gradients as backward writes them (stages 0-1 keep them whole in this dtype).
        master_bytes: the fp32 master copy kept with the optimizer states without offload (0 when the
            parameters are fp32: they are their own master).
        activation_bytes: activations (the compute dtype).
        reduce_bytes: gradients as they are reduced and kept as slices at stages 2-3 (``zero.reduce_dtype:
            fp32``: 4; else ``grad_bytes``).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    activation_bytes: int
    reduce_bytes: int

    @property
    def label(self) -> str:
        """``name``, with ``" (reduce fp32)"`` when gradients are reduced wider than they are computed."""
        return self.name + (" (reduce fp32)" if self.reduce_bytes > self.grad_bytes else "")


PRECISIONS = {"fp32": Precision("fp32", 4, 4, 0, 4, 4), "bf16": Precision("bf16", 2, 2, 4, 2, 2),
              "fp16": Precision("fp16", 2, 2, 4, 2, 2)}
#: ``zero.offload_optimizer`` values, and ``all`` (every variant the machine supports).
OFFLOADS = ("none", "cpu", "disk", "all")


def precision_of(name: str, reduce_dtype: str | None = None, flag: str = "--precision") -> Precision:
    """The :class:`Precision` of ``precision: name`` with ``zero.reduce_dtype`` (``None`` or ``"fp32"``).

    Raises:
        ZerorunError: ``name`` is not fp32, bf16 or fp16; the message names ``flag``.
    """
    if name not in PRECISIONS:
        raise ZerorunError(f"{flag}: {name!r} is not one of fp32, bf16, fp16")
    p = PRECISIONS[name]
    return replace(p, reduce_bytes=4) if reduce_dtype == "fp32" else p


#: Bytes per element of each ``zero.grad_accum_dtype`` value.
GRAD_ACCUM_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}


def grad_accum_bytes(precision: Precision, grad_accum_steps: int, grad_accum_dtype: str | None = None) -> int:
    """Bytes per element in which gradients are accumulated over micro-steps (``zero.grad_accum_dtype``,
    DeepSpeed's ``data_types.grad_accum_dtype``): the given dtype; unset (``None``), fp32 when
    ``grad_accum_steps`` > 1 under bf16/fp16 and the gradients' own dtype otherwise.

    Raises:
        ZerorunError: ``grad_accum_dtype`` not fp32, bf16 or fp16 (names ``zero.grad_accum_dtype``).
    """
    if grad_accum_dtype is None:
        return 4 if grad_accum_steps > 1 and precision.name in ("bf16", "fp16") else precision.grad_bytes
    if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
        raise ZerorunError(f"zero.grad_accum_dtype: {grad_accum_dtype!r} is not one of fp32, bf16, fp16")
    return GRAD_ACCUM_DTYPES[grad_accum_dtype]


@dataclass(frozen=True)
class OptimizerModel:
    """What an optimizer keeps per element of the tensors it updates.

    Attributes:
        states: fp32 state tensors of the parameter's size (Adam: ``exp_avg``, ``exp_avg_sq``: 2; SGD with
            momentum: 1).
        scalar_bytes: bytes of scalar state tensors per updated tensor (Adam's ``step``: a float32 scalar, 4),
            one per flat buffer; counted only where the layout is known.
    """

    name: str
    states: int
    scalar_bytes: int


def optimizer_model(name: str, kwargs: dict[str, Any] | None = None, flag: str = "--optimizer") -> OptimizerModel:
    """The :class:`OptimizerModel` of a ``torch.optim`` optimizer ``name`` (or ``adam``, ``sgd``, ``none``) with
    its keyword arguments (``momentum``, ``amsgrad``, ``centered`` change the state count).

    Raises:
        ZerorunError: an optimizer whose states are not modelled; the message names ``flag``.
    """
    kw = kwargs or {}
    key = name.lower()
    if key == "none":
        return OptimizerModel(name, 0, 0)
    if key in ("adam", "adamw"):
        return OptimizerModel(name, 3 if kw.get("amsgrad") else 2, 4)
    if key in ("radam", "adamax", "adadelta"):
        return OptimizerModel(name, 2, 4)
    if key == "nadam":
        return OptimizerModel(name, 2, 8)  # step and mu_product
    if key == "rprop":
        return OptimizerModel(name, 2, 4)
    if key == "adagrad":
        return OptimizerModel(name, 1, 4)
    if key == "asgd":
        return OptimizerModel(name, 1, 12)  # ax; step, eta and mu
    if key == "rmsprop":
        return OptimizerModel(name, 1 + bool(kw.get("momentum")) + bool(kw.get("centered")), 4)
    if key == "sgd":
        return OptimizerModel(name, 1 if kw.get("momentum", 0.9 if name == "sgd" else 0) else 0, 0)
    raise ZerorunError(f"{flag}: no memory model for optimizer {name!r}; use adam, sgd, none or one of "
                       "Adam, AdamW, NAdam, RAdam, Adamax, Adadelta, Adagrad, ASGD, RMSprop, Rprop, SGD")
