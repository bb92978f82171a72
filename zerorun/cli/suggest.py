"""An unknown option that names a recipe field (``zerorun train r.yaml --steps 10``) answered with the override
that sets it (``train.steps=10``): the fields are the recipe models' own (pydantic), not a list kept here."""

from __future__ import annotations

import shlex
import typing
from functools import lru_cache


def _model_in(annotation) -> type | None:
    """The pydantic model an annotation holds (``LogSpec``, ``HFModelSpec | None``), else None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, typing.get_args(annotation)) if m is not None), None)


@lru_cache(maxsize=1)
def recipe_fields() -> dict[str, object]:
    """``{dotted path: annotation}`` of every leaf field of :class:`zerorun.recipe.Recipe` (``train.steps``,
    ``zero.stage``, ``model.hf.pretrained``, ...), nested models walked, in the models' order."""
    from zerorun.recipe import Recipe

    found: dict[str, object] = {}

    def walk(model, prefix: str) -> None:
        for name, field in model.model_fields.items():
            inner = _model_in(field.annotation)
            if inner is None:
                found[prefix + name] = field.annotation
            else:
                walk(inner, f"{prefix}{name}.")

    walk(Recipe, "")
    return found


def matching_fields(option: str) -> list[str]:
    """The recipe fields ``option`` names: its words (``--micro-batch-size``: micro_batch_size) as a field's
    name, its dotted path (``--zero.stage``) or that path with underscores (``--zero-stage``)."""
    word = option.lstrip("-").replace("-", "_")
    if not word:
        return []
    return [path for path in recipe_fields()
            if word in (path, path.replace(".", "_")) or path.endswith("." + word)]


def _value(argv: list[str], option: str, path: str) -> str:
    """The value given with ``option`` in ``argv`` (``--steps=10``, ``--steps 10``); ``true`` for a bool field
    given as a flag; else ``VALUE``."""
    for i, arg in enumerate(argv):
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
        if arg == option:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and (not nxt.startswith("-") or nxt[1:2].isdigit() or nxt[1:2] == "."):
                return nxt
            break
    return "true" if recipe_fields()[path] is bool else "VALUE"


def override_hint(argv: list[str], option: str) -> str | None:
    """``"; recipe fields are set by overrides: train.steps=10"`` when the unknown ``option`` (as click names
    it) is a recipe field's name in ``argv`` (the command's arguments), several joined by ``or``; else None."""
    paths = matching_fields(option)
    if not paths:
        return None
    shown = " or ".join(shlex.quote(f"{path}={_value(argv, option, path)}") for path in paths)
    return f"; recipe fields are set by overrides: {shown}"


_STARTS_NODES = "zerorun starts every node itself from the hostfile (-H; --launcher ssh or slurm)"
#: torchrun options ``zerorun launch`` has no use for, with what does their work here (a review: each said only
#: "No such option")
TORCHRUN_ONLY = {
    "rdzv-backend": f"no rendezvous to set up: {_STARTS_NODES}",
    "rdzv-endpoint": f"no rendezvous to set up: {_STARTS_NODES}",
    "rdzv-id": f"no rendezvous to set up: {_STARTS_NODES}",
    "rdzv-conf": f"no rendezvous to set up: {_STARTS_NODES}",
    "node-rank": f"a node's rank is its place in the hostfile: {_STARTS_NODES}",
    "local-addr": f"the hostfile's names are the nodes' addresses: {_STARTS_NODES}",
    "tee": "every rank's output is on the console and in output.log in the run folder (--log-dir: its parent)",
    "redirects": "every rank's output is on the console and in output.log in the run folder (--log-dir: its parent)",
    "no-python": "zerorun launch runs a Python script (or -m module) on every rank",
    "start-method": "the ranks are started as torchrun's default does",
}


def torchrun_hint(argv: list[str], option: str) -> str | None:
    """``: <what does its work>`` for a torchrun option ``zerorun launch`` does not take, else None."""
    if argv[1:2] != ["launch"]:
        return None
    key = option.lstrip("-").split("=", 1)[0].replace("_", "-")
    return f": a torchrun option; {TORCHRUN_ONLY[key]}" if key in TORCHRUN_ONLY else None
