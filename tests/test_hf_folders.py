"""model.hf on folders as the Hub has them (a review): a config.json written by transformers 4, a weight missing
from the files, and a tied model whose folder still holds its LM head apart; every stage builds the model that
``from_pretrained`` builds, or one line names what is wrong."""

from __future__ import annotations

import json
import os
import shutil

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
pytest.importorskip("transformers")

import torch  # noqa: E402

from zerorun.errors import ZerorunError  # noqa: E402
from zerorun.hf.model import build_model  # noqa: E402
from zerorun.rank.userload import call_factory  # noqa: E402

from test_hf import _maker  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A tiny tied Llama saved with ``save_pretrained`` (no ``lm_head.weight`` in its file)."""
    root = tmp_path_factory.mktemp("hf_folders")
    return _maker().make_model(str(root / "llama"), "llama", vocab_size=61, hidden_size=16, intermediate_size=24)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_a_transformers_4_config_is_read(llama, tmp_path):
    """``torch_dtype``, ``rope_theta`` and ``rope_scaling`` (nearly every Hub folder) were refused as unknown
    keys, although transformers reads them; a typo is still refused."""
    folder = _copy(llama, tmp_path / "v4")
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    theta = (cfg.pop("rope_parameters", None) or {}).get("rope_theta", 10000.0)
    cfg.pop("dtype", None)
    cfg.update(torch_dtype="float32", rope_theta=theta, rope_scaling=None)
    with open(path, "w") as f:
        json.dump(cfg, f)
    ids = torch.arange(12).view(2, 6) % 61
    assert torch.equal(_logits(build_model(pretrained=folder), ids), _logits(build_model(pretrained=llama), ids))
    from transformers import AutoConfig

    from zerorun.hf.model import load_config

    for scaling in ({"type": "linear", "factor": 4.0}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}):
        cfg.update(rope_theta=500000.0, rope_scaling=scaling)  # the theta was lost: 10000 (the check's probe)
        with open(path, "w") as f:
            json.dump(cfg, f)
        assert load_config(folder).rope_parameters == AutoConfig.from_pretrained(folder).rope_parameters
        assert load_config(folder).rope_parameters["rope_theta"] == 500000.0
    cfg["hidden_sizee"] = 8
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ZerorunError, match=r"unknown llama config key 'hidden_sizee' \(did you mean 'hidden_size'"):
        build_model(pretrained=folder)


def test_a_weight_missing_from_the_folder_is_refused_at_every_stage(llama, tmp_path):
    """Stages 0-2 (``from_pretrained``) trained the layer from random values without a word; stage 3 refused."""
    from safetensors.torch import load_file, save_file

    folder = _copy(llama, tmp_path / "missing")
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ZerorunError, match=r"^model\.hf\.pretrained: .*missing has no weights for "
                                           r"model\.layers\.1\.mlp\.up_proj\.weight \(1 missing"):
        call_factory("zerorun.hf.model", "build_model", {"pretrained": folder})  # as the ranks build it: not
        # wrapped in "zerorun.hf.model: build_model(**{...}) raised ZerorunError" (a review)


def test_a_tied_model_stored_with_its_own_head_is_untied_at_every_stage(llama, tmp_path):
    """A folder whose config ties the head to the embedding but which holds a different ``lm_head.weight``:
    ``from_pretrained`` unties them; stage 3's build (meta) tied them and read the embedding only, and the
    export re-tied the trained head (a review: logits 25 apart)."""
    from safetensors.torch import load_file, save_file

    from zerorun.hf.export import _write_model
    from zerorun.hf.model import load_config

    folder = _copy(llama, tmp_path / "tiedextra")
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    head = torch.randn(state["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(5))
    save_file({**state, "lm_head.weight": head}, path, metadata={"format": "pt"})
    whole = build_model(pretrained=folder).hf
    with torch.device("meta"):
        meta = build_model(pretrained=folder).hf
    for model in (whole, meta):
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(whole.lm_head.weight, head)
    assert [n for n, _ in meta.named_parameters()] == [n for n, _ in whole.named_parameters()]
    from zerorun.hf.model import distinct_tied

    asked = []  # only the tied weights' tensors are read: stage 3 reads no whole tensor on a rank (Note [Slice reads])
    assert distinct_tied(whole, lambda name: asked.append(name) or state.get(name)) is None
    assert sorted(asked) == [], asked  # untied now: nothing to compare
    with torch.device("meta"):
        tied = build_model(pretrained=llama).hf
    distinct_tied(tied, lambda name: asked.append(name) or None)
    assert sorted(asked) == ["lm_head.weight", "model.embed_tokens.weight"], asked
    trained = {f"hf.{k}": v for k, v in whole.state_dict().items()}
    out = tmp_path / "export"
    out.mkdir()
    _write_model(load_config(folder), trained, "ckpt", str(out), "5GB")
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.equal(exported.lm_head.weight, head)
    ids = torch.arange(12).view(2, 6) % 61
    assert torch.equal(_logits(exported, ids), _logits(whole, ids))


def test_a_hub_kernel_is_refused(llama):
    """``attn_implementation: kernels-community/flash-attn`` reached transformers' Hub kernel loader, stopped only
    by the offline flags (a kernel in the local cache would have run)."""
    with pytest.raises(ZerorunError, match=r"^model\.kwargs\.attn_implementation: 'kernels-community/flash-attn' "
                                           r"names a kernel on the Hugging Face Hub"):
        build_model(pretrained=llama, attn_implementation="kernels-community/flash-attn")


def test_an_export_that_does_not_fit_its_config_is_one_line(llama, tmp_path):
    """A checkpoint exported with a config of fewer layers dropped the trained layer without a word; one of
    another intermediate size ended in a bare traceback (a review: config.json edited after training)."""
    from zerorun.hf.export import _write_model
    from zerorun.hf.model import load_config

    trained = {f"hf.{k}": v for k, v in build_model(pretrained=llama).hf.state_dict().items()}
    fewer = load_config(llama)
    fewer.num_hidden_layers = 1
    with pytest.raises(ZerorunError, match=r"^ckpt: the checkpoint holds model\.layers\.1\..*, not of the llama model "
                                           r"of its config \(0 missing, 9 more\)$"):
        _write_model(fewer, trained, "ckpt", str(tmp_path), "5GB")
    wider = load_config(llama)
    wider.intermediate_size = 32
    with pytest.raises(ZerorunError, match=r"^ckpt: the checkpoint does not fit the llama model of its config: size "
                                           r"mismatch for model\.layers\.0\.mlp\.gate_proj\.weight"):
        _write_model(wider, trained, "ckpt", str(tmp_path), "5GB")


def test_an_export_replaces_the_tokenizer_and_says_when_it_has_none(tmp_path, monkeypatch, capsys):
    """An export into a folder holding an earlier export kept that one's tokenizer files (a byte-level model
    beside a BPE tokenizer); a tokenizer folder gone since training left the export without one, unsaid."""
    from safetensors.torch import save_file

    from zerorun import checkpoint
    from zerorun.hf import export

    out = tmp_path / "out"
    out.mkdir()
    for name in ("tokenizer.json", "vocab.json", "model.safetensors", "notes.txt"):
        (out / name).write_text("old")
    meta = {"recipe": {"model": {"hf": {"config": {"model_type": "llama"}}},
                       "data": {"tokenizer": str(tmp_path / "gone")}}}
    monkeypatch.setattr(checkpoint, "resolve", lambda ckpt: ckpt)
    monkeypatch.setattr(checkpoint, "check", lambda path: meta)
    monkeypatch.setattr(checkpoint, "consolidate", lambda path, full: save_file({}, full))
    monkeypatch.setattr(export, "_write_model", lambda cfg, state, path, tmp, size: save_file(
        {"w": torch.zeros(2)}, os.path.join(tmp, "model.safetensors")))
    export.export_hf("ckpt", str(out))
    assert sorted(os.listdir(out)) == ["model.safetensors", "notes.txt"]  # the user's own file stays
    assert capsys.readouterr().err == (f"zerorun: warning: data.tokenizer {tmp_path / 'gone'}: not a folder (moved or "
                                       "removed since training): the export has no tokenizer files\n")


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_the_tiny_folder_s_model_stops_at_its_tokenizer_s_eos(tmp_path, monkeypatch, model):
    """recipes/make_hf_tiny.py wrote bos 1, eos 2 (Llama's defaults: id 2 is '"' here) or GPT-2's 50256, outside
    the vocabulary of 512, beside a tokenizer whose eos is <|endoftext|>, id 0 (a review)."""
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    maker = _maker()
    monkeypatch.setattr(maker, "make_jsonl", lambda path: path)
    monkeypatch.setattr(sys, "argv", ["make_hf_tiny.py", str(tmp_path), "--model", model])
    maker.main()
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|endoftext|>"
    for cfg in (hf.config, hf.generation_config):
        assert (cfg.bos_token_id, cfg.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)


def test_a_broken_folder_is_named_at_stages_0_to_2_as_at_stage_3(llama, tmp_path):
    """A truncated file said "SafetensorError: ... incomplete metadata" naming no file, a tensor of another shape
    "look at the above report" (which was not shown), where stage 3 names both (a review)."""
    from safetensors.torch import load_file, save_file

    folder = _copy(llama, tmp_path / "shape")
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(20, 16)
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ZerorunError, match=r"^model\.hf\.pretrained: model\.layers\.0\.mlp\.up_proj\.weight in .*shape "
                                           r"has shape \[20, 16\], the model expects \[24, 16\]$"):
        build_model(pretrained=folder)
    folder = _copy(llama, tmp_path / "cut")
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(ZerorunError, match=r"^model\.hf\.pretrained: .*cut/model\.safetensors: not a readable "
                                           r"safetensors file: "):
        build_model(pretrained=folder)
