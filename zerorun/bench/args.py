"""``zerorun bench``'s arguments: the stages, baselines and node counts it is given, and the overrides it refuses
(the fields it sets for every job)."""

from __future__ import annotations

from zerorun.errors import ZerorunError

BASELINES = ("ddp", "fsdp2")

#: ``--zero-variants``: stage 3's ZeRO++ switches (docs/across-nodes.md) as recipe overrides; ``flat``: none
ZERO_VARIANTS: dict[str, list[str]] = {
    "flat": [],
    "hpz": ["zero.hierarchy=node"],
    "qwz": ["zero.quantize_weights=int8"],
    "hpz+qwz": ["zero.hierarchy=node", "zero.quantize_weights=int8"],
    "qgz": ["zero.quantize_grads=int8"],
    "hpz+qwz+qgz": ["zero.hierarchy=node", "zero.quantize_weights=int8", "zero.quantize_grads=int8"],
}


#: Recipe fields every bench job sets itself (Combo.overrides): the user sets them through the flags instead.
CONTROLLED = {"train.steps": "--steps and --warmup", "zero.stage": "--stages", "runtime": "--baseline",
              "log.every": "bench (a step event every step)", "train.eval_every": "bench (no evaluation)",
              "checkpoint.every": "bench (no checkpoints)", "checkpoint.dir": "bench (no checkpoints)"}


def check_overrides(overrides: list[str]) -> None:
    """Refuse ``FIELD=VALUE`` overrides of the fields bench sets for every job (:data:`CONTROLLED`): they
    would be silently replaced, bad values included.

    Raises:
        ZerorunError: such an override, naming it and the flag that sets the field.
    """
    for item in overrides:
        field = item.split("=", 1)[0].strip()
        if field in CONTROLLED:
            raise ZerorunError(f"override {item!r}: bench sets {field} for every job; use {CONTROLLED[field]}")


def parse_stages(text: str) -> list[int]:
    """``"0,1,2,3"`` -> ``[0, 1, 2, 3]``.

    Raises:
        ZerorunError: an item that is not a ZeRO stage (0-3), or none at all.
    """
    stages = []
    for item in (t.strip() for t in text.split(",")):
        if item not in ("0", "1", "2", "3"):
            raise ZerorunError(f"--stages {text}: {item!r} is not a ZeRO stage (0, 1, 2 or 3)")
        if int(item) not in stages:
            stages.append(int(item))
    return stages


def parse_baselines(text: str | None) -> list[str]:
    """``"ddp,fsdp2"`` -> ``["ddp", "fsdp2"]`` (``None`` or ``""``: none).

    Raises:
        ZerorunError: an unknown baseline.
    """
    out = []
    for item in (t.strip() for t in (text or "").split(",") if t.strip()):
        if item not in BASELINES:
            raise ZerorunError(f"--baseline {text}: unknown baseline {item!r} (choose from {', '.join(BASELINES)})")
        if item not in out:
            out.append(item)
    return out


def parse_nodes(text: str | None) -> list[int]:
    """``"1,2"`` -> ``[1, 2]`` (``None`` or ``""``: none): node counts of the SLURM allocation to bench on.

    Raises:
        ZerorunError: an item that is not a positive whole number.
    """
    out = []
    for item in (t.strip() for t in (text or "").split(",") if t.strip()):
        if not item.isdigit() or int(item) < 1:
            raise ZerorunError(f"--nodes {text}: {item!r} is not a node count (1, 2, ...)")
        if int(item) not in out:
            out.append(int(item))
    return out


def parse_zero_variants(text: str | None, stages: list[int]) -> list[str]:
    """``"flat,hpz"`` -> ``["flat", "hpz"]`` (``None`` or ``""``: none): the variants of stage 3 to run, each
    one row (:data:`ZERO_VARIANTS`).

    Raises:
        ZerorunError: an unknown variant, or variants without stage 3 in ``stages``.
    """
    out = []
    for item in (t.strip() for t in (text or "").split(",") if t.strip()):
        if item not in ZERO_VARIANTS:
            raise ZerorunError(f"--zero-variants {text}: unknown variant {item!r} (choose from "
                               f"{', '.join(ZERO_VARIANTS)})")
        if item not in out:
            out.append(item)
    if out and 3 not in stages:
        raise ZerorunError(f"--zero-variants {text}: variants of stage 3; --stages has no 3")
    return out
