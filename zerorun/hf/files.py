"""The Hugging Face files a recipe names, read without ``transformers`` or torch (milliseconds, not seconds):
a model's ``config.json`` up to its ``model_type``, and a tokenizer folder's claim to code of its own.

Note [HF checks after the header]: the launcher printed nothing for 8-19 s on an HF recipe, because checking
``model.hf`` and the tokenizer imported torch and ``transformers`` before the job's header. The launcher now
checks only what these files say (:func:`read_config`, :func:`refuse_remote_code`, the folders and files
being there) before it prints; the checks that need ``transformers`` (the config class's own values, a causal-lm
model for it, the tokenizer's vocabulary against the model's, the data's fields) run in the model check beside
the launch (Note [Model check beside the launch] in zerorun/rank/modelcheck.py), which loads the recipe with every
check and stops the job with the same one line; with no local host (no model check there) the launcher runs
them itself, as before.
"""

from __future__ import annotations

import json
import os

from zerorun.errors import ZerorunError

#: why ``trust_remote_code`` is refused (the recipe's field or the keyword is named in front)
REMOTE_CODE = ("zerorun never runs a model folder's own code (its auto_map); the architecture comes from "
               "config.json's model_type")


def read_json(path: str, what: str) -> dict:
    """The JSON object in ``path``.

    Raises:
        ZerorunError: ``<path>: cannot read <what>`` / ``is not valid JSON`` / ``must be a JSON object``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ZerorunError(f"{path}: cannot read {what}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ZerorunError(f"{path}: {what} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ZerorunError(f"{path}: {what} must be a JSON object")
    return data


def read_config(pretrained: str | None = None, config: str | dict | None = None,
                where: str = "model.hf") -> tuple[dict, str, str]:
    """``(values, field, model_type)`` of ``pretrained`` (a local folder with ``config.json``) or ``config`` (a
    path to a ``config.json`` or the mapping itself); ``field``: ``pretrained`` or ``config``.

    Raises:
        ZerorunError: one line naming ``where``: neither or both given, folder or file missing, not JSON, no
            ``model_type``.
    """
    if (pretrained is None) == (config is None):
        raise ZerorunError(f"{where}: give exactly one of pretrained (a local folder) or config (a config.json "
                           "path or mapping)")
    if pretrained is not None:
        if not os.path.isdir(pretrained):
            raise ZerorunError(f"{where}.pretrained: not a folder: {pretrained}")
        path = os.path.join(pretrained, "config.json")
        if not os.path.isfile(path):
            raise ZerorunError(f"{where}.pretrained: no config.json in {pretrained}")
        data, field = read_json(path, "config.json"), "pretrained"
    elif isinstance(config, str):
        if not os.path.isfile(config):
            raise ZerorunError(f"{where}.config: file not found: {config}")
        data, field = read_json(config, "config"), "config"
    else:
        data, field = dict(config), "config"
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise ZerorunError(f"{where}.{field}: the config has no model_type (e.g. llama, gpt2)")
    return data, field, model_type


def safetensors_files(folder: str) -> list[str]:
    """The ``*.safetensors`` files of ``folder``, sorted.

    Raises:
        ZerorunError: there is none (``pytorch_model.bin`` is not read: it would need unpickling).
    """
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ZerorunError(f"model.hf.pretrained: no *.safetensors files in {folder} (pickled .bin weights are "
                           "not loaded; save with save_pretrained(safe_serialization=True))")
    return [os.path.join(folder, f) for f in files]


def remote_code(folder: str) -> str | None:
    """The file of tokenizer ``folder`` that names tokenizer code of its own (``auto_map`` in
    ``tokenizer_config.json``, or an ``AutoTokenizer`` entry of ``config.json``'s), or ``None``. zerorun loads
    tokenizers with ``trust_remote_code=False`` only: transformers would otherwise ask "Do you wish to run the
    custom code? [y/N]" and, on a "y" from stdin, import the folder's module."""
    for name, key in (("tokenizer_config.json", None), ("config.json", "AutoTokenizer")):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                auto_map = json.load(f).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue
        if auto_map and (key is None or isinstance(auto_map, dict) and key in auto_map):
            return os.path.join(folder, name)
    return None


def refuse_remote_code(folder: str) -> None:
    """Raise when tokenizer ``folder`` names code of its own (:func:`remote_code`).

    Raises:
        ZerorunError: ``data.tokenizer: <file>: auto_map names tokenizer code ...``, one line.
    """
    found = remote_code(folder)
    if found:
        raise ZerorunError(f"data.tokenizer: {found}: auto_map names tokenizer code of the folder: zerorun never "
                           "runs a model folder's code (trust_remote_code); use a folder with a tokenizer.json "
                           "and a standard tokenizer_class, or remove auto_map")


def tokenizer_json_size(folder: str) -> int | None:
    """The number of token ids of ``folder``'s ``tokenizer.json`` (its model's vocabulary and added tokens: the
    largest id + 1), read as JSON without ``transformers`` (Note [HF checks after the header]); None when the
    folder has no such file or it is not of that shape (the model check's own reading then decides)."""
    path = os.path.join(folder, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        vocab = data["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t["id"] for t in data.get("added_tokens") or []]
        return max(ids) + 1 if ids and all(isinstance(i, int) for i in ids) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
