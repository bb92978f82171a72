"""Recipe checks for the Hugging Face fields (``model.hf``, ``data.kind: hf``), called by
:func:`zerorun.recipe.resolve`: paths made absolute, the config read and checked, the data's text field found,
each problem one line naming the recipe field."""

from __future__ import annotations

import os
from typing import Callable

from zerorun.errors import ZerorunError


def _path(value: str, base: str) -> str:
    """``value`` made absolute: relative to the working directory when it exists there, else to ``base``."""
    value = os.path.expanduser(value)
    for root in (os.getcwd(), base):
        candidate = os.path.abspath(os.path.join(root, value))
        if os.path.exists(candidate):
            return candidate
    return os.path.abspath(value)


def resolve_hf_model(model, base: str, where: Callable[..., str]) -> None:
    """Make ``model.hf``'s paths absolute and check that its config can be read and has a causal-lm model.

    Raises:
        ZerorunError: ``<recipe>:<line>: model.hf...: <problem>``.
    """
    from zerorun.hf.model import check_causal_lm, load_config, safetensors_files

    hf = model.hf
    if hf.pretrained is not None:
        hf.pretrained = _path(hf.pretrained, base)
    if isinstance(hf.config, str):
        hf.config = _path(hf.config, base)
    field = "pretrained" if hf.pretrained is not None else "config"
    try:
        cfg = load_config(hf.pretrained, hf.config, where="model.hf")
        check_causal_lm(cfg)
        if hf.pretrained is not None:
            safetensors_files(hf.pretrained)
    except ZerorunError as e:
        msg = str(e)
        # load_config names the field (model.hf.x: ...); put the recipe's file and line in front of it
        prefix = where("model", "hf", field) if hf.pretrained is not None or hf.config is not None else where("model", "hf")
        for head in (f"model.hf.{field}: ", "model.hf: "):
            if msg.startswith(head):
                msg = msg[len(head):]
        raise ZerorunError(f"{prefix}: {msg}") from None
    if model.factory != "build_model":
        raise ZerorunError(f"{where('model', 'factory')}: a model module's factory; model.hf takes none")
