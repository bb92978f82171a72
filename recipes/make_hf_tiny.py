"""Make the local Hugging Face folder that ``recipes/hf-llama-tiny.yaml`` trains from: a tiny Llama (or
GPT-2) built from a config with HF's own initialization, a byte-level BPE tokenizer trained with ``tokenizers``
on the Python standard library's sources, both saved with ``save_pretrained``; and a JSONL file of stdlib
sources for ``data.kind: hf``. Nothing is downloaded.

    python recipes/make_hf_tiny.py runs/hf-llama-tiny-model            # --model gpt2 for a GPT-2
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256, tie_word_embeddings=True),
}


def stdlib_files(pattern: str = "json/*.py") -> list[str]:
    """Sorted standard-library source files matching ``pattern`` (the same corpus on every machine)."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], pattern)))


def make_tokenizer(out: str, vocab_size: int = 512, files: list[str] | None = None):
    """Train a byte-level BPE tokenizer on ``files`` (default: stdlib json/*.py), save it to ``out`` with
    ``save_pretrained`` and return it (a ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files or stdlib_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast


def make_model(out: str, model_type: str = "llama", vocab_size: int = 512, seed: int = 0, **overrides) -> str:
    """Build ``CONFIGS[model_type]`` (plus ``overrides``) with ``from_config`` (HF's initialization, seeded)
    and save it to ``out`` as safetensors with ``save_pretrained``. Returns ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {**CONFIGS[model_type], "vocab_size": vocab_size, **overrides}
    cfg = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def make_jsonl(path: str, files: list[str] | None = None) -> str:
    """A JSONL file with one ``{"text": source, "path": name}`` record per stdlib file. Returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        for name in files or stdlib_files():
            with open(name, encoding="utf-8") as src:
                f.write(json.dumps({"text": src.read(), "path": os.path.basename(name)}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder to write (model, tokenizer, data.jsonl)")
    parser.add_argument("--model", choices=sorted(CONFIGS), default="llama")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tok = make_tokenizer(args.out)  # the model's bos/eos are the tokenizer's (generate() stopped at '"', id 2)
    make_model(args.out, args.model, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    make_jsonl(os.path.join(args.out, "data.jsonl"))
    print(f"wrote {args.out}: config.json, model.safetensors, tokenizer files, data.jsonl")


if __name__ == "__main__":
    main()
