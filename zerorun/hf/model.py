"""``model.hf``: a ``transformers`` causal language model from a local config or a local pretrained folder,
wrapped so that zerorun's batches reach it as ``input_ids``/``labels``/``attention_mask``.

The recipe's ``model: {hf: {...}, task: causal-lm}`` is turned into the model source
``("zerorun.hf.model", "build_model", {...})`` (:meth:`zerorun.recipe.ModelSpec.source`), so the worker, the
launcher's model check and ``zerorun estimate`` build it the way they build any user module.

Note [Pretrained at stage 3]: under ``torch.device("meta")`` (stage 3's deferred init, the model check,
``zerorun estimate``) :func:`build_model` builds the architecture from the folder's ``config.json`` only and
records the folder in :attr:`CausalLM.pretrained`; the worker then fills each rank's slices from the
safetensors files (:func:`zerorun.hf.load.load_pretrained_slices`). Anywhere else it calls
``from_pretrained`` and every rank holds the whole model, as stages 0-2 do anyway.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from zerorun.errors import ZerorunError
from zerorun.hf import offline
from zerorun.hf.files import REMOTE_CODE, read_config, safetensors_files

#: the prefix of the Hugging Face model's parameter names inside :class:`CausalLM` (``hf.model.embed_tokens...``)
PREFIX = "hf."


class CausalLM(nn.Module):
    """A ``transformers`` ``*ForCausalLM`` model whose ``forward(batch)`` takes zerorun's batch.

    ``batch``: an int64 tensor ``(B, T)`` of token ids (inputs and labels: the model shifts labels itself), or
    a dict with ``input_ids`` ``(B, T)`` and optionally ``attention_mask`` ``(B, T)`` (positions with 0 get
    label -100, ignored by the loss) and ``labels`` ``(B, T)``. Returns the model's output, whose ``loss`` is
    the mean cross-entropy over predicted tokens (a 0-dim float tensor).

    Attributes:
        hf: the wrapped ``PreTrainedModel``.
        pretrained: the folder whose safetensors still have to be loaded into this model (built on the meta
            device from that folder's config), else ``None`` (Note [Pretrained at stage 3]).
    """

    def __init__(self, hf: nn.Module, pretrained: str | None = None) -> None:
        super().__init__()
        self.hf = hf
        self.pretrained = pretrained
        cfg = hf.config
        layers, width = getattr(cfg, "num_hidden_layers", None), getattr(cfg, "hidden_size", None)
        if isinstance(layers, int) and isinstance(width, int):
            # read by telemetry's FLOP count (attention term); not the full shape, so zerorun estimate does
            # not apply its GPT activation formula to another block design
            self.shape = {"n_layer": layers, "d_model": width}

    def zerorun_model_config(self) -> dict[str, Any]:
        """The wrapped model's config as JSON-able values (``model_type`` among them): saved with every checkpoint,
        ``zerorun consolidate --hf`` rebuilds the trained model from it (zerorun/checkpoint/saving.py)."""
        import json

        return json.loads(self.hf.config.to_json_string(use_diff=False))

    def forward(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            ids, mask, labels = batch, None, batch
        elif isinstance(batch, dict) and "input_ids" in batch:
            ids, mask, labels = batch["input_ids"], batch.get("attention_mask"), batch.get("labels")
            if labels is None:
                labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
        else:
            from zerorun.rank.userload import UserCodeError

            raise UserCodeError(f"model.hf: task causal-lm takes a tensor of token ids or a dict with input_ids, "
                                f"got {type(batch).__name__}")
        return self.hf(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)


def load_config(pretrained: str | None = None, config: str | dict | None = None, where: str = "model.hf"):
    """The ``transformers`` config of ``pretrained`` (a local folder with ``config.json``) or ``config`` (a
    path to a ``config.json`` or the mapping itself, with ``model_type``), read offline.

    Raises:
        ZerorunError: one line naming ``where``: folder or file missing, not JSON, no or unknown
            ``model_type``, or values the config class refuses.
    """
    offline()
    data, field, model_type = read_config(pretrained, config, where)
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ZerorunError(f"{where}.{field}: unknown model_type {model_type!r} for this transformers version")
    values = {k: v for k, v in data.items() if k != "model_type"}
    _check_known_keys(values, CONFIG_MAPPING[model_type], f"{where}.{field}", model_type)
    try:
        return AutoConfig.for_model(model_type, **values)
    except Exception as e:  # noqa: BLE001 - the config class's own checks
        reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise ZerorunError(f"{where}.{field}: invalid {model_type} config: {type(e).__name__}: {reason}") from None


def _check_known_keys(values: dict, config_class, where: str, model_type: str) -> None:
    """Refuse a key the config class does not know (a typo such as ``hidden_sizee``: transformers keeps it as
    an attribute and builds the default size instead, which can be far larger than meant). A key transformers
    takes in its own way is known too: a legacy name it converts (``torch_dtype``, ``rope_theta`` and
    ``rope_scaling``, which nearly every folder written by transformers 4 has; refused before a review) or a
    generation setting it moves out; what it keeps as a plain attribute is a typo.

    Raises:
        ZerorunError: naming the key and the closest known one.
    """
    import difflib
    import inspect

    known = set(config_class().to_dict()) | set(inspect.signature(config_class.__init__).parameters) | {"auto_map"}
    for key in values:
        if key not in known and not key.startswith("_") and _kept_as_attribute(config_class, key, values[key]):
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise ZerorunError(f"{where}: unknown {model_type} config key {key!r}"
                               + (f" (did you mean {close[0]!r}?)" if close else ""))


def _kept_as_attribute(config_class, key: str, value: Any) -> bool:
    """Whether ``config_class(key=value)`` keeps ``key`` as a plain attribute (transformers' way with a key it
    does not know); a key it converts or moves out is not kept. A value the class refuses counts as kept."""
    import copy
    import logging

    quiet = logging.getLogger("transformers")
    level, quiet.level = quiet.level, logging.ERROR  # its deprecation notes for the legacy names
    try:  # a copy: transformers writes into the value (rope_scaling gained rope_theta 10000; a review)
        return key in config_class(**{key: copy.deepcopy(value)}).to_dict()
    except Exception:  # noqa: BLE001 - the class's own checks: the key's error is the one to give
        return True
    finally:
        quiet.level = level


#: model types whose AutoModelForCausalLM class trains no causal language model on ``labels=input_ids``
NOT_CAUSAL = frozenset({"xlm", "xlnet"})


def check_causal_lm(cfg, where: str = "model.hf") -> None:
    """Raise :class:`ZerorunError` when ``AutoModelForCausalLM`` has no model class for ``cfg``, or when that
    class is an encoder's (BERT, RoBERTa, ELECTRA, ...) and ``cfg.is_decoder`` is false: it then attends to
    later tokens, so the causal-lm labels leak into the input (transformers only logs a warning; its class checks
    ``not config.is_decoder``, which is how such a class is told apart); or a model type of :data:`NOT_CAUSAL`."""
    import inspect

    from transformers import AutoModelForCausalLM

    if type(cfg) not in AutoModelForCausalLM._model_mapping:
        raise ZerorunError(f"{where}: model_type {cfg.model_type!r} has no causal-lm model "
                           "(AutoModelForCausalLM)")
    cls = AutoModelForCausalLM._model_mapping[type(cfg)]
    try:
        encoder = "not config.is_decoder" in inspect.getsource(cls.__init__)
    except (OSError, TypeError):  # no source shipped
        encoder = False
    if cfg.model_type in NOT_CAUSAL:  # no flag makes them causal: refused whatever the config says
        raise ZerorunError(f"{where}: model_type {cfg.model_type!r} has a causal-lm class ({cls.__name__}) that is "
                           "not one: it attends to later tokens and its loss does not shift the labels (each "
                           "position predicts its own input token)")
    if encoder and not getattr(cfg, "is_decoder", False):
        raise ZerorunError(f"{where}: model_type {cfg.model_type!r} is an encoder: its causal-lm model "
                           f"({cls.__name__}) lets each position see later tokens unless the config sets "
                           "is_decoder: true (in model.hf.config, or the folder's config.json)")


def build_model(*, pretrained: str | None = None, config: str | dict | None = None, task: str = "causal-lm",
                **kwargs: Any) -> CausalLM:
    """The :class:`CausalLM` of a local pretrained folder or a config, fp32, from local files only, never
    running the folder's own code (``trust_remote_code=False`` whatever ``auto_map`` says).

    On the meta device a pretrained model is built from its config only (Note [Pretrained at stage 3]).
    ``kwargs`` go to ``from_config``/``from_pretrained`` (e.g. ``attn_implementation: eager``).

    Raises:
        ZerorunError: as :func:`load_config`; an unknown task; a model type without a causal-lm head;
            ``trust_remote_code`` true in ``kwargs``, or an ``attn_implementation`` of the Hub's; a weight missing
            from a pretrained folder (as stage 3's loader).
    """
    if task != "causal-lm":
        raise ZerorunError(f"model.task: unknown task {task!r} (known: causal-lm)")
    if kwargs.pop("trust_remote_code", False):
        raise ZerorunError(f"model.kwargs.trust_remote_code: {REMOTE_CODE}")
    impl = kwargs.get("attn_implementation")
    if isinstance(impl, str) and "/" in impl:  # transformers fetches and runs a kernel from the Hub (a review)
        raise ZerorunError(f"model.kwargs.attn_implementation: {impl!r} names a kernel on the Hugging Face Hub: "
                           "zerorun never runs code from the Hub; use eager, sdpa or an installed one "
                           "(flash_attention_2)")
    cfg = load_config(pretrained, config)
    check_causal_lm(cfg)
    from transformers import AutoModelForCausalLM

    on_meta = torch.empty(0).device.type == "meta"
    if pretrained is not None and not on_meta:
        files = safetensors_files(pretrained)
        try:
            hf, info = AutoModelForCausalLM.from_pretrained(pretrained, config=cfg, dtype=torch.float32,
                                                            local_files_only=True, trust_remote_code=False,
                                                            output_loading_info=True, **kwargs)
        except Exception:  # noqa: BLE001 - named as stage 3's loader names it, where it can be; else as raised
            _diagnose(pretrained, files, cfg)
            raise
        if info.get("missing_keys"):  # transformers initializes them at random, with a log line only
            raise ZerorunError(f"model.hf.pretrained: {pretrained} has no weights for "
                               f"{sorted(info['missing_keys'])[0]} ({len(info['missing_keys'])} missing; "
                               f"{len(files)} safetensors file{'s' * (len(files) != 1)})")
        return CausalLM(hf)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, trust_remote_code=False, **kwargs)
    if pretrained is not None and distinct_tied(hf, _folder_tensors(pretrained)):
        cfg.tie_word_embeddings = False  # Note [Tied weights stored apart]
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, trust_remote_code=False, **kwargs)
    return CausalLM(hf, pretrained=pretrained)


def distinct_tied(hf: nn.Module, stored: Callable[[str], torch.Tensor | None]) -> str | None:
    """Note [Tied weights stored apart]: a folder (or checkpoint) of a model whose config ties weights
    (``tie_word_embeddings``: the LM head is the input embedding) may still hold each of them, with different
    values; ``from_pretrained`` then unties them and loads both. Stage 3 builds the model from the config on
    the meta device and loaded only the first (and ``consolidate --hf`` re-tied the trained head to the
    embedding): a different model at stage 3 than at stages 0-2 (a review). Returns the first name of a tied
    parameter of ``hf`` whose stored tensor (``stored(name)``: None when not stored) differs from another of
    its names', else None; the caller builds the model untied."""
    names: dict[int, list[str]] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for group in (g for g in names.values() if len(g) > 1):  # tied ones only: the others are never read
        tensors = [(n, t) for n in group if (t := stored(n)) is not None]
        for name, t in tensors[1:]:
            if t.shape != tensors[0][1].shape or not torch.equal(t, tensors[0][1]):
                return name
    return None


def _diagnose(folder: str, files: list[str], cfg) -> None:
    """Why ``from_pretrained`` failed on ``folder``, in one line naming the file and tensor, as stage 3's loader
    says it (zerorun/hf/load.py): transformers named neither ("SafetensorError: incomplete metadata", "look at
    the above report"; a review).

    Raises:
        ZerorunError: a file that is not safetensors (or truncated), a tensor of another shape than the model's.
    """
    from transformers import AutoModelForCausalLM

    shapes = {key: shape for key, (_, shape) in _stored(files).items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, trust_remote_code=False)
    for name, p in model.named_parameters():
        if name in shapes and shapes[name] != list(p.shape):
            raise ZerorunError(f"model.hf.pretrained: {name} in {folder} has shape {shapes[name]}, the model "
                               f"expects {list(p.shape)}")


def _stored(files: list[str]) -> dict[str, tuple[str, list[int]]]:
    """``{tensor name: (its file, its shape)}`` of safetensors ``files``, from their headers.

    Raises:
        ZerorunError: a file that is not safetensors, or truncated, naming it.
    """
    from safetensors import safe_open

    out = {}
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                out.update({key: (path, list(f.get_slice(key).get_shape())) for key in f.keys()})
        except Exception as e:  # noqa: BLE001 - safetensors' own error types
            raise ZerorunError(f"model.hf.pretrained: {path}: not a readable safetensors file: {e}") from None
    return out


def _folder_tensors(folder: str) -> Callable[[str], torch.Tensor | None]:
    """``name -> tensor`` of the folder's safetensors files (None when none holds it), read on demand; the
    headers are read at the first call."""
    from safetensors import safe_open

    where: dict[str, tuple[str, list[int]]] = {}

    def read(name: str) -> torch.Tensor | None:
        if not where:
            where.update(_stored(safetensors_files(folder)))
        if name not in where:
            return None
        with safe_open(where[name][0], "pt") as f:
            return f.get_tensor(name)

    return read
