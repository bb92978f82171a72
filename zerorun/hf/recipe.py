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


def resolve_hf_model(model, base: str, where: Callable[..., str], deep: bool = True) -> None:
    """Make ``model.hf``'s paths absolute and check that its config can be read and has a causal-lm model;
    ``deep=False``: only what its files say, without ``transformers`` (Note [HF checks after the header] in
    zerorun/hf/files.py).

    Raises:
        ZerorunError: ``<recipe>:<line>: model.hf...: <problem>``.
    """
    from zerorun.hf.files import REMOTE_CODE, read_config, safetensors_files

    if (model.kwargs or {}).get("trust_remote_code"):
        raise ZerorunError(f"{where('model', 'kwargs', 'trust_remote_code')}: {REMOTE_CODE}")
    hf = model.hf
    if hf.pretrained is not None:
        hf.pretrained = _path(hf.pretrained, base)
    if isinstance(hf.config, str):
        hf.config = _path(hf.config, base)
    field = "pretrained" if hf.pretrained is not None else "config"
    try:
        if deep:
            from zerorun.hf.model import check_causal_lm, load_config

            cfg = load_config(hf.pretrained, hf.config, where="model.hf")
            check_causal_lm(cfg)
            vocab = getattr(cfg, "vocab_size", None)
        else:  # the config's vocab_size from its JSON (Note [HF checks after the header]): check_vocab's
            vocab = read_config(hf.pretrained, hf.config, where="model.hf")[0].get("vocab_size")
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
    model._hf_vocab_size = vocab if isinstance(vocab, int) else None  # for check_vocab, not serialized
    if model.factory != "build_model":
        raise ZerorunError(f"{where('model', 'factory')}: a model module's factory; model.hf takes none")


def resolve_hf_data(data, base: str, where: Callable[..., str], deep: bool = True) -> None:
    """``data.kind: hf``: make ``path`` and ``tokenizer`` absolute, check the source's format and that its
    records have ``text_field`` (first record or schema only; not with ``deep=False``, Note [HF checks after the
    header] in zerorun/hf/files.py), and that the tokenizer folder exists and names no code of its own.

    Raises:
        ZerorunError: ``<recipe>:<line>: data.<field>: <problem>``.
    """
    if data.path is None:
        raise ZerorunError(f"{where('data')}: kind 'hf' needs data.path (a .jsonl/.parquet/.txt file or a "
                           "save_to_disk folder)")
    if data.paths:
        raise ZerorunError(f"{where('data', 'paths')}: kind 'hf' reads data.path; paths are kind 'text''s")
    data.path = _path(data.path, base)
    if not deep and not os.path.exists(data.path):
        raise ZerorunError(f"{where('data', 'path')}: not found: {data.path}")
    try:
        columns = None
        if deep:
            from zerorun.hf.data import columns_of  # imports torch

            columns = columns_of(data.path)
    except ZerorunError as e:
        msg = str(e)
        raise ZerorunError(f"{where('data', 'path')}: {msg[len('data.path: '):] if msg.startswith('data.path: ') else msg}") from None
    if columns is not None and data.text_field not in columns:
        raise ZerorunError(f"{where('data', 'text_field')}: {data.text_field!r} is not a field of {data.path} "
                           f"(fields: {', '.join(columns) or 'none'})")
    if data.tokenizer is not None:
        data.tokenizer = _path(data.tokenizer, base)
        if not os.path.isdir(data.tokenizer):
            raise ZerorunError(f"{where('data', 'tokenizer')}: not a folder: {data.tokenizer}")
        if not any(os.path.isfile(os.path.join(data.tokenizer, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ZerorunError(f"{where('data', 'tokenizer')}: no tokenizer.json in {data.tokenizer}")
        from zerorun.hf.files import refuse_remote_code

        try:
            refuse_remote_code(data.tokenizer)
        except ZerorunError as e:
            raise ZerorunError(f"{where('data', 'tokenizer')}: {str(e).removeprefix('data.tokenizer: ')}") from None


def check_vocab(model, data, where: Callable[..., str], deep: bool = True) -> None:
    """A ``model.hf`` must embed every id its data yields: ``data.kind: text`` bytes (256), ``hf`` the
    tokenizer's ids (``len(tokenizer)``, 256 byte-level); else ranks would fail inside the embedding. Not
    ``deep`` (the launcher before its header): the ids ``tokenizer.json`` holds, read as JSON, where it has them.

    Raises:
        ZerorunError: the data's vocabulary is larger than the model config's ``vocab_size``.
    """
    vocab = getattr(model, "_hf_vocab_size", None)
    if vocab is None or data.kind not in ("text", "hf"):
        return
    need, what = 256, "byte-level data (256 ids)"
    if data.kind == "hf" and data.tokenizer is not None:
        from zerorun.hf.files import tokenizer_json_size

        try:  # tokenizer.json's ids, without transformers: before the ranks start (they printed IndexErrors first)
            if deep:
                from zerorun.hf.data import Tokenizer  # imports torch and transformers

                need = Tokenizer(data.tokenizer).vocab_size
            else:
                need = tokenizer_json_size(data.tokenizer)
        except ZerorunError as e:
            raise ZerorunError(f"{where('data', 'tokenizer')}: {str(e).removeprefix('data.tokenizer: ')}") from None
        if need is None:
            return  # not a tokenizer.json zerorun reads itself: the model check's deep check says it
        what = f"the tokenizer in {data.tokenizer}"
    if need > vocab:
        field = where("data", "tokenizer") if data.kind == "hf" and data.tokenizer else where("data", "kind")
        raise ZerorunError(f"{field}: {what} has {need} token ids, more than the model's vocab_size {vocab}")
