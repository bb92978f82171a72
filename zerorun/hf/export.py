"""``zerorun consolidate CKPT --out DIR --hf``: a checkpoint of a ``model.hf`` recipe written as a Hugging Face
folder that ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.

The checkpoint is first consolidated into one fp32 safetensors file (:func:`zerorun.checkpoint.consolidate`,
in a temporary folder beside ``DIR``, removed afterwards); its tensors, memory-mapped, are assigned to a model built on the meta device
from the recipe's config, and ``save_pretrained`` writes ``config.json``, ``generation_config.json`` and the
weights (tied weights once; shards of at most ``max_shard_size`` with an index above it). The values are the
checkpoint's fp32 master weights, bit for bit. The tokenizer files of the recipe's ``data.tokenizer`` folder
are copied beside them.
"""

from __future__ import annotations

import os
import shutil
import sys

from zerorun.checkpoint.safety import why_not_written
from zerorun.errors import ZerorunError
from zerorun.files import apply_umask

#: files of a tokenizer folder copied into the export (those ``save_pretrained`` of a tokenizer writes)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def _copy_tokenizer(folder: str, out: str) -> None:
    """Copy the :data:`TOKENIZER_FILES` of ``folder`` into ``out``, ``tokenizer_config.json`` without
    ``auto_map`` (the folder's own tokenizer code is not copied: the export would name code it does not hold,
    and loading it would need ``trust_remote_code``)."""
    import json

    for name in TOKENIZER_FILES:
        src = os.path.join(folder, name)
        if not os.path.isfile(src):
            continue
        if name == "tokenizer_config.json":
            try:
                with open(src, encoding="utf-8") as f:
                    config = json.load(f)
            except ValueError as e:
                raise ZerorunError(f"{src}: not valid JSON ({e})") from None
            if isinstance(config, dict) and "auto_map" in config:
                del config["auto_map"]
                with open(os.path.join(out, name), "w", encoding="utf-8") as f:
                    json.dump(config, f, indent=2, ensure_ascii=False)
                continue
        shutil.copyfile(src, os.path.join(out, name))


def export_hf(ckpt: str, out: str, max_shard_size: str = "5GB") -> tuple[int, int]:
    """Write the model of checkpoint ``ckpt`` (a step folder, or a folder of them: the latest) as a Hugging
    Face folder ``out``: written complete in a temporary sibling folder first, then moved in (files of the same
    names, and a previous export's weight files, are replaced), so a failed export leaves ``out`` as it was.

    Returns:
        ``(weight files written, total bytes of them)``.

    Raises:
        ZerorunError: the checkpoint's recipe has no ``model.hf``, or as :func:`zerorun.checkpoint.consolidate`.
    """
    from zerorun import checkpoint
    from zerorun.hf import offline
    from zerorun.hf.model import load_config

    offline()
    _check_shard_size(max_shard_size)
    path = checkpoint.resolve(ckpt)
    meta = checkpoint.check(path)
    recipe = meta.get("recipe") or {}
    hf = (recipe.get("model") or {}).get("hf")
    if not hf:
        raise ZerorunError(f"{path}: --hf needs a checkpoint of a model.hf recipe (this one trained "
                           f"{(recipe.get('model') or {}).get('module')}); drop --hf for a plain state dict")
    saved = meta.get("model_config")  # the config it trained (older checkpoints: the recipe's folder or config)
    cfg = load_config(config=saved, where=f"{path}: model_config") if isinstance(saved, dict) else \
        load_config(hf.get("pretrained"), hf.get("config"))
    out = os.path.abspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ZerorunError(f"--out {out}: not a directory")
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{os.getpid()}.tmp")
    try:
        os.makedirs(tmp)
        full = os.path.join(tmp, ".zerorun-full.safetensors")
        checkpoint.consolidate(path, full)
        from safetensors.torch import load_file

        _write_model(cfg, load_file(full), path, tmp, max_shard_size)
        os.remove(full)
        tokenizer = (recipe.get("data") or {}).get("tokenizer")
        if tokenizer and os.path.isdir(tokenizer):
            _copy_tokenizer(tokenizer, tmp)
        elif tokenizer:  # the export had none, without a word (a review)
            sys.stderr.write(f"zerorun: warning: data.tokenizer {tokenizer}: not a folder (moved or removed since "
                             "training): the export has no tokenizer files\n")
        for name in os.listdir(tmp):  # safetensors writes 0600: the umask's permissions (zerorun/files.py)
            apply_umask(os.path.join(tmp, name))
        _move_in(tmp, out)  # complete: now replace
    except ZerorunError:
        raise
    except Exception as e:  # noqa: BLE001 - a full disk (safetensors' own error type), a read-only folder: one line
        raise ZerorunError(f"--out {out}: cannot write: {why_not_written(e, os.path.dirname(out))}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    weights = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    return len(weights), sum(os.path.getsize(os.path.join(out, f)) for f in weights)


def _check_shard_size(size: str) -> None:
    """Raises ZerorunError unless ``size`` is a positive size as ``save_pretrained`` reads it ("5GB", "500MB",
    "2GiB"): "banana" and "0" were transformers' traceback, "-5MB" one file per tensor."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        nbytes = convert_file_size_to_int(size)
    except ValueError:
        nbytes = None
    if nbytes is None or nbytes <= 0:
        raise ZerorunError(f"--max-shard-size {size}: give a positive whole number and a unit, as 5GB, 500MB or "
                           "2GiB")


def _write_model(cfg, full_state: dict, path: str, tmp: str, max_shard_size: str) -> None:
    """Build ``cfg``'s model on the meta device, give it the checkpoint's weights (``full_state``: the
    consolidated fp32 state, keys with the model's prefix) and ``save_pretrained`` it into ``tmp``.

    Raises:
        ZerorunError: the checkpoint lacks a persistent entry of the model.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from zerorun.hf.model import PREFIX, distinct_tied

    state = {k[len(PREFIX):]: v for k, v in full_state.items() if k.startswith(PREFIX)}
    # Note [Untrusted checkpoints]: the recipe in zerorun.json is the checkpoint's, not the user's: the
    # architecture comes from the config's model_type alone (no auto_map, no trust_remote_code, none of
    # the recipe's model.kwargs), so no code named by the checkpoint is ever imported
    if "auto_map" in vars(cfg):
        delattr(cfg, "auto_map")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, trust_remote_code=False)
        if distinct_tied(model, state.get):  # trained apart: kept apart (Note [Tied weights stored apart])
            cfg.tie_word_embeddings = False
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, trust_remote_code=False)
    persistent = set(model.state_dict())
    missing, extra = sorted(persistent - set(state)), sorted(set(state) - persistent)
    if missing or extra:  # an extra tensor was dropped without a word (a config edited after training)
        what = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, not"
        raise ZerorunError(f"{path}: the checkpoint {what} of the {cfg.model_type} model of its config "
                           f"({len(missing)} missing, {len(extra)} more)")
    try:
        model.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as e:  # a shape the config does not give: a traceback before
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e))
        raise ZerorunError(f"{path}: the checkpoint does not fit the {cfg.model_type} model of its config: "
                           f"{first}") from None
    model.tie_weights()
    model.save_pretrained(tmp, max_shard_size=max_shard_size, safe_serialization=True)


def _move_in(tmp: str, out: str) -> None:
    """Move the complete export in ``tmp`` to ``out``: into an existing folder, replacing files of the same
    names and a previous export's weight and tokenizer files (its shards would mix with this one's, its
    tokenizer would stand for another); else ``tmp`` becomes ``out``."""
    if os.path.isdir(out):
        for name in os.listdir(out):  # a previous export's tokenizer files too: a byte-level model kept a BPE's
            if (name.startswith("model") and name.endswith((".safetensors", ".index.json"))
                    or name in TOKENIZER_FILES):
                os.remove(os.path.join(out, name))
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
    else:
        os.replace(tmp, out)
