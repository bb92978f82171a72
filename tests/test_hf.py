"""model.hf / data.kind hf / consolidate --hf: a tiny Llama and GPT-2 made from configs and a BPE tokenizer
trained with ``tokenizers`` on stdlib sources, saved with ``save_pretrained`` in a temporary folder (never a
download; the HF offline flags are set)."""

from __future__ import annotations

import importlib.util
import hashlib
import json
import shutil
import os
import subprocess
import sys

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
pytest.importorskip("transformers")  # the 'hf' extra (in 'test' too)
pytest.importorskip("pyarrow")

import hf_cases as cases  # noqa: E402

from zerorun.errors import ZerorunError  # noqa: E402
from zerorun.recipe import load_recipe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


def _maker():
    spec = importlib.util.spec_from_file_location("make_hf_tiny", os.path.join(ROOT, "recipes/make_hf_tiny.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """``{"llama": folder, "gpt2": folder, "tok": folder, "jsonl": file, "root": tmp}``: models with tied
    embeddings (odd sizes: slices cut rows), tokenizer files in the Llama folder too."""
    make = _maker()
    root = tmp_path_factory.mktemp("hf")
    tok = str(root / "tok")
    make.make_tokenizer(tok, vocab_size=300)
    llama = make.make_model(str(root / "llama"), "llama", vocab_size=301, hidden_size=40, intermediate_size=70)
    make.make_tokenizer(llama, vocab_size=300)
    gpt2 = make.make_model(str(root / "gpt2"), "gpt2", vocab_size=301, n_embd=36, n_head=3)
    untied = make.make_model(str(root / "untied"), "llama", vocab_size=301, hidden_size=40, intermediate_size=70,
                             tie_word_embeddings=False)
    jsonl = make.make_jsonl(str(root / "data.jsonl"))
    return {"llama": llama, "gpt2": gpt2, "untied": untied, "tok": tok, "jsonl": jsonl, "root": root}


def _recipe(path, model: dict, data: dict | None = None, **extra) -> str:
    doc = {"name": "hf", "model": model,
           "data": data or {"kind": "text", "paths": ["{stdlib}/json/*.py"], "seq_len": 16},
           "train": {"steps": 3, "micro_batch_size": 2}, **extra}
    with open(path, "w") as f:
        json.dump(doc, f)  # JSON is YAML
    return str(path)


# ------------------------------------------------------------------------------------------ recipe errors
@pytest.mark.parametrize("model,pattern", [
    ({"hf": {"pretrained": "no/such/folder"}}, r"^.*r\.yaml:1: model\.hf\.pretrained: not a folder: "),
    ({"hf": {"config": "nope.json"}}, r"model\.hf\.config: file not found: "),
    ({"hf": {"config": {"hidden_size": 8}}}, r"model\.hf\.config: the config has no model_type"),
    ({"hf": {"config": {"model_type": "no-such-arch"}}}, r"model\.hf\.config: unknown model_type 'no-such-arch'"),
    ({"hf": {"config": {"model_type": "vit"}}}, r"model\.hf\.config: model_type 'vit' has no causal-lm model"),
    ({"hf": {"config": {"model_type": "llama", "hidden_sizee": 32}}},
     r"model\.hf\.config: unknown llama config key 'hidden_sizee' \(did you mean 'hidden_size'\?\)"),
    ({"hf": {"config": {"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4}}},
     r"model\.hf\.config: invalid llama config: .*The hidden size \(30\) is not a multiple"),
    ({"hf": {"config": {"model_type": "llama"}, "weights": 1}}, r"model\.hf\.weights: unknown field"),
    ({"hf": {"config": {"model_type": "llama"}}, "task": "seq2seq"}, r"model\.task: Input should be 'causal-lm'"),
    ({"hf": {"config": {"model_type": "llama"}}, "module": "m.py"}, r"model: give model\.module .* one of them"),
    ({"factory": "f"}, r"model: give model\.module .* one of them"),
    ({"module": os.path.join(ROOT, "recipes/models/gpt.py"), "task": "causal-lm"}, r"model\.task: a model\.hf field"),
    # a review: a model_type's own code ran (model.kwargs went to from_pretrained), and BERT trained as a
    # causal LM attending to later tokens, both without a word
    ({"hf": {"config": {"model_type": "llama"}}, "kwargs": {"trust_remote_code": True}},
     r"^.*r\.yaml:1: model\.kwargs\.trust_remote_code: zerorun never runs a model folder's own code \(its auto_map\)"),
    ({"hf": {"config": {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                        "intermediate_size": 64}}},
     r"model\.hf\.config: model_type 'bert' is an encoder: its causal-lm model \(BertLMHeadModel\) lets each "
     r"position see later tokens unless the config sets is_decoder: true"),
    ({"hf": {"config": {"model_type": "xlnet", "d_model": 32, "n_layer": 1, "n_head": 2, "d_inner": 64}}},
     r"model\.hf\.config: model_type 'xlnet' has a causal-lm class \(XLNetLMHeadModel\) that is not one"),
    ({"hf": {"config": {"model_type": "xlm", "emb_dim": 32, "n_layers": 1, "n_heads": 2, "is_encoder": False}}},
     r"model\.hf\.config: model_type 'xlm' has a causal-lm class \(XLMWithLMHeadModel\) that is not one"),
])
def test_bad_hf_model_is_one_line(tmp_path, model, pattern):
    with pytest.raises(ZerorunError, match=pattern) as e:
        load_recipe(_recipe(tmp_path / "r.yaml", model))
    assert "\n" not in str(e.value)


def test_bad_config_files_are_one_line(tmp_path, hf_dir):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ZerorunError, match=r"model\.hf\.config: .*bad\.json: config is not valid JSON"):
        load_recipe(_recipe(tmp_path / "r.yaml", {"hf": {"config": str(tmp_path / "bad.json")}}))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(open(os.path.join(hf_dir["llama"], "config.json")).read())
    with pytest.raises(ZerorunError, match=r"model\.hf\.pretrained: no \*\.safetensors files in "):
        load_recipe(_recipe(tmp_path / "r.yaml", {"hf": {"pretrained": str(empty)}}))


def test_hf_recipe_resolves_and_builds_on_meta(tmp_path, hf_dir):
    import torch

    from zerorun.rank.userload import build_model

    # relative to the recipe's folder (Note [Recipe paths])
    r = load_recipe(_recipe(tmp_path / "r.yaml", {"hf": {"pretrained": os.path.relpath(hf_dir["llama"], tmp_path)}}))
    assert r.model.hf.pretrained == hf_dir["llama"]
    module, factory, kwargs = r.model.source()
    assert (module, factory, kwargs["task"]) == ("zerorun.hf.model", "build_model", "causal-lm")
    with torch.device("meta"):
        m = build_model(module, factory, kwargs)
    assert m.pretrained == hf_dir["llama"] and next(m.parameters()).is_meta


def test_bad_hf_recipe_exits_2_with_one_line(tmp_path):
    path = _recipe(tmp_path / "r.yaml", {"hf": {"pretrained": str(tmp_path / "missing")}})
    proc = subprocess.run([sys.executable, "-m", "zerorun", "train", path, "--no-dashboard"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "model.hf.pretrained: not a folder" in lines[0], lines


def test_data_vocabulary_larger_than_the_model_is_one_line(tmp_path, hf_dir):
    small = {"hf": {"config": {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
                               "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 200}}}
    for deep in (True, False):  # also before the ranks start (they printed IndexErrors first: a review)
        with pytest.raises(ZerorunError, match=r"r\.yaml:1: data\.tokenizer: the tokenizer in .* has 300 token "
                                               r"ids, more than the model's vocab_size 200"):
            load_recipe(_recipe(tmp_path / "r.yaml", small, {"kind": "hf", "path": hf_dir["jsonl"],
                                                             "tokenizer": hf_dir["tok"]}), check_hf=deep)
    small["hf"]["config"]["vocab_size"] = 100
    with pytest.raises(ZerorunError, match=r"data\.kind: byte-level data \(256 ids\) has 256 token ids"):
        load_recipe(_recipe(tmp_path / "r.yaml", small))
    small["hf"]["config"]["vocab_size"] = 300
    load_recipe(_recipe(tmp_path / "r.yaml", small, {"kind": "hf", "path": hf_dir["jsonl"], "tokenizer": hf_dir["tok"]}))


def _custom_code_tokenizer(hf_dir, tmp_path, where: str = "tokenizer_config.json"):
    """A copy of the tokenizer folder whose ``where`` names a module of the folder in auto_map (a tokenizer
    class of its own, as remote-code repositories do); the module creates ``pwned`` when imported."""
    folder = tmp_path / "custom-tok"
    shutil.copytree(hf_dir["tok"], folder)
    pwned = tmp_path / "pwned"
    (folder / "evil_tok.py").write_text(f"import pathlib\npathlib.Path({str(pwned)!r}).touch()\n"
                                        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    path = folder / where
    config = json.loads(path.read_text()) if path.exists() else {"model_type": "llama"}
    config["auto_map"] = {"AutoTokenizer": ["evil_tok.EvilTokenizer", "evil_tok.EvilTokenizer"]}
    path.write_text(json.dumps(config))
    return str(folder), pwned


def test_a_model_folder_s_own_code_never_runs(tmp_path, hf_dir):
    """A Llama folder whose config.json has an auto_map naming its own module: the module ran when model.kwargs
    (or a library call) passed trust_remote_code=True on to from_pretrained (a review); now that is refused in
    one line, and without it the folder builds as the model_type's class, its module never imported."""
    import shutil

    from zerorun.hf.model import build_model

    folder, pwned = tmp_path / "remote", tmp_path / "PWNED"
    shutil.copytree(hf_dir["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_my.MyModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_my.py").write_text(f"open({str(pwned)!r}, 'w').write('ran')\n")
    with pytest.raises(ZerorunError, match=r"^model\.kwargs\.trust_remote_code: zerorun never runs a model folder's"):
        build_model(pretrained=str(folder), trust_remote_code=True)
    assert type(build_model(pretrained=str(folder)).hf).__name__ == "LlamaForCausalLM"
    assert not pwned.exists()


@pytest.mark.parametrize("where", ["tokenizer_config.json", "config.json"])
def test_tokenizer_folder_with_its_own_code_is_one_line_no_prompt(tmp_path, hf_dir, where):
    """transformers asked "Do you wish to run the custom code? [y/N]" and, on a "y" from stdin (`yes | zerorun
    train`), imported the folder's module in the launcher: now one line naming the file, nothing imported."""
    from zerorun.hf.data import Tokenizer

    folder, pwned = _custom_code_tokenizer(hf_dir, tmp_path, where)
    with pytest.raises(ZerorunError, match=rf"data\.tokenizer: {folder}/{where}: auto_map names tokenizer code"):
        Tokenizer(folder)
    small = {"hf": {"config": {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
                               "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 300}}}
    recipe = _recipe(tmp_path / "r.yaml", small, {"kind": "hf", "path": hf_dir["jsonl"], "tokenizer": folder},
                     log={"dir": str(tmp_path / "runs")})
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", recipe, "--no-dashboard"], input="y\n" * 50,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stdout + out.stderr
    assert f"r.yaml:1: data.tokenizer: {folder}/{where}: auto_map names tokenizer code" in out.stderr
    assert "custom code" not in out.stdout + out.stderr and not pwned.exists()
    assert not (tmp_path / "runs").exists()


def test_estimate_takes_model_hf(tmp_path):
    """zerorun estimate builds a model.hf from its config on the meta device: every parameter, tied ones once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerorun.estimate import layout_of_recipe

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
           "num_attention_heads": 4, "vocab_size": 1000, "tie_word_embeddings": True}
    r = load_recipe(_recipe(tmp_path / "r.yaml", {"hf": {"config": cfg}},
                            zero={"stage": 3, "units": ["LlamaDecoderLayer"]}))
    layout = layout_of_recipe(r)
    values = dict(cfg)
    expected = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values)).num_parameters()
    assert layout.total == layout.trainable == expected
    # three decoder layers, the final norm (an outer unit: Note [Outer units]; the embedding is tied) and the root
    assert len(layout.units) == 5 and [u.name for u in layout.units if u.outer] == ["hf.model.norm"]


# ------------------------------------------------------------------------------------------ data kind hf
def _formats(root, jsonl: str) -> dict:
    """The same records as JSONL, Parquet, a save_to_disk-layout folder (arrow stream + state.json)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [json.loads(line)["text"] for line in open(jsonl)]
    table = pa.table({"text": texts, "n": list(range(len(texts)))})
    pq.write_table(table, str(root / "d.parquet"), row_group_size=3)
    folder = root / "saved"
    folder.mkdir(exist_ok=True)
    with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=4)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return {"jsonl": jsonl, "parquet": str(root / "d.parquet"), "saved": str(folder)}


def test_hf_data_formats_cache_and_streaming(tmp_path, hf_dir, monkeypatch):
    import shutil

    import torch

    from zerorun.hf import data as hfdata
    from zerorun.recipe import DataSpec

    jsonl = shutil.copy(hf_dir["jsonl"], tmp_path / "d.jsonl")
    paths = _formats(tmp_path, str(jsonl))
    calls = []
    encode = hfdata.Tokenizer.encode
    monkeypatch.setattr(hfdata, "BATCH_BYTES", 5_000)  # streamed in batches, never the whole text at once
    monkeypatch.setattr(hfdata.Tokenizer, "encode", lambda self, texts: calls.append(sum(map(len, texts))) or encode(self, texts))
    blocks = {}
    for fmt, path in paths.items():
        train, val = hfdata.build_hf_datasets(DataSpec(kind="hf", path=path, tokenizer=hf_dir["tok"], seq_len=32,
                                                       val_fraction=0.1))
        blocks[fmt] = torch.stack([train[i] for i in range(len(train))])
        assert val is not None and train[0].dtype == torch.int64 and train[0].shape == (32,)
    assert torch.equal(blocks["jsonl"], blocks["parquet"]) and torch.equal(blocks["jsonl"], blocks["saved"])
    assert blocks["jsonl"].max() < 300 and len(calls) >= 3 * len(paths) and 0 not in calls, calls
    longest = max(len(json.loads(line)["text"]) for line in open(jsonl))
    assert max(calls) < 5_000 + longest  # one batch: up to the batch size, plus the record that crosses it
    # the cache is reused: no tokenizing the second time
    folder, cache = hfdata.cache_paths(str(jsonl), "text", hfdata.Tokenizer(hf_dir["tok"]))
    assert os.path.isfile(cache)
    calls.clear()
    again, _ = hfdata.build_hf_datasets(DataSpec(kind="hf", path=str(jsonl), tokenizer=hf_dir["tok"], seq_len=32,
                                                 val_fraction=0.1))
    assert calls == [] and torch.equal(again[3], blocks["jsonl"][3])
    # a changed file makes a new cache and removes the stale one
    with open(jsonl, "a") as f:
        f.write(json.dumps({"text": "def added():\n    return 1\n" * 50}) + "\n")
    changed, _ = hfdata.build_hf_datasets(DataSpec(kind="hf", path=str(jsonl), tokenizer=hf_dir["tok"], seq_len=32,
                                                   val_fraction=0.1))
    assert calls and not os.path.exists(cache) and len(os.listdir(folder)) == 2
    # another tokenizer: another cache (byte-level without a tokenizer folder: vocabulary 256)
    other, _ = hfdata.build_hf_datasets(DataSpec(kind="hf", path=str(jsonl), seq_len=32))
    assert other[0].max() < 256 and len(other) > len(changed)
    # plain text: one document, byte-level
    (tmp_path / "t.txt").write_text("hello world\n" * 100)
    text, _ = hfdata.build_hf_datasets(DataSpec(kind="hf", path=str(tmp_path / "t.txt"), seq_len=12, val_fraction=0))
    assert len(text) == 100 and bytes(text[1].tolist()) == b"hello world\n"
    # ... with a tokenizer too, in several batches of lines: no eos between them (a review: one every 4 MiB)
    (tmp_path / "t.txt").write_text("hello world\n" * 1000)
    calls.clear()
    text, _ = hfdata.build_hf_datasets(DataSpec(kind="hf", path=str(tmp_path / "t.txt"), tokenizer=hf_dir["tok"],
                                                seq_len=4, val_fraction=0))
    ids = torch.cat([text[i] for i in range(len(text))])
    eos = hfdata.Tokenizer(hf_dir["tok"]).eos
    assert eos is not None and eos not in ids.tolist() and len(calls) == 3, calls


@pytest.mark.parametrize("data,pattern", [
    ({"kind": "hf"}, r"r\.yaml:1: data: kind 'hf' needs data\.path"),
    ({"kind": "hf", "path": "nope.jsonl"}, r"data\.path: not found: .*nope\.jsonl"),
    ({"kind": "hf", "path": "JSONL", "text_field": "body"}, r"data\.text_field: 'body' is not a field of .* \(fields: text, path\)"),
    ({"kind": "hf", "path": "PARQUET", "text_field": "body"}, r"data\.text_field: 'body' is not a field of .* \(fields: text, n\)"),
    ({"kind": "hf", "path": "SAVED", "text_field": "body"}, r"data\.text_field: 'body' is not a field of "),
    ({"kind": "hf", "path": "JSONL", "tokenizer": "nowhere"}, r"data\.tokenizer: not a folder: "),
    ({"kind": "hf", "path": "r.yaml"}, r"data\.path: .*r\.yaml: unknown format"),
    ({"kind": "text", "paths": ["{stdlib}/json/*.py"], "tokenizer": "tok"}, r"data\.tokenizer: a data\.kind 'hf' field"),
    # a review: a traceback (pyarrow's ArrowInvalid naming no file; UnicodeDecodeError under estimate), and an
    # empty JSONL blamed on text_field
    ({"kind": "hf", "path": "e.parquet"}, r"data\.path: .*e\.parquet: not a readable parquet file: .*0 bytes"),
    ({"kind": "hf", "path": "bad.parquet"}, r"data\.path: .*bad\.parquet: not a readable parquet file: "),
    ({"kind": "hf", "path": "bin.jsonl"}, r"data\.path: .*bin\.jsonl:1: not JSON: 'utf-8' codec can't decode"),
    ({"kind": "hf", "path": "e.jsonl"}, r"data\.path: .*e\.jsonl: no records in it \(an empty file\)"),
])
def test_bad_hf_data_is_one_line(tmp_path, hf_dir, data, pattern):
    paths = _formats(tmp_path, hf_dir["jsonl"])
    (tmp_path / "e.parquet").write_bytes(b"")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 4)
    (tmp_path / "bin.jsonl").write_bytes(b"\x80\x81 garbage\n")
    (tmp_path / "e.jsonl").write_bytes(b"\n\n")
    data = dict(data, seq_len=16)
    data["path"] = {"JSONL": paths["jsonl"], "PARQUET": paths["parquet"], "SAVED": paths["saved"]}.get(
        data.get("path"), data.get("path"))
    if data["path"] is None:
        del data["path"]
    with pytest.raises(ZerorunError, match=pattern) as e:
        load_recipe(_recipe(tmp_path / "r.yaml", {"hf": {"pretrained": hf_dir["llama"]}}, data))
    assert "\n" not in str(e.value)


def test_bad_record_is_one_line(tmp_path, hf_dir):
    from zerorun.hf.data import build_hf_datasets
    from zerorun.recipe import DataSpec

    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ZerorunError, match=r"d\.jsonl:2: data\.text_field 'text': missing$"):
        build_hf_datasets(DataSpec(kind="hf", path=str(tmp_path / "d.jsonl"), seq_len=4))


# ------------------------------------------------------------------------------------------ stage 3 parity
@pytest.mark.slow
@pytest.mark.parametrize("arch,unit", [("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block"),
                                       ("untied", "LlamaDecoderLayer")])
def test_stage3_from_pretrained_matches_stage0(ranks, hf_dir, arch, unit):
    for rank, r in enumerate(ranks(2).run(cases.stage3_matches_stage0, folder=hf_dir[arch], units=[unit])):
        assert r["tied"] == (arch != "untied"), r
        assert r["init_equal"], f"rank {rank}: stage 3 did not start from the pretrained weights: {r}"
        assert r["changed"], r
        for key in ("loss", "grad_norm", "params"):
            assert r[key] <= TOL, f"rank {rank}: {key} differs from stage 0 by {r[key]:.3g} ({r})"
        # each rank reads its half of the weights (plus partial rows at its slice ends), not the model
        assert r["read_bytes"] < 0.6 * r["model_bytes"], r


@pytest.mark.slow
def test_stage3_from_pretrained_in_bf16_equals_stage0(ranks, hf_dir):
    """bf16: every stage makes its fp32 masters from the bf16 parameters (Note [Mixed precision]); stage 3 read
    the file's fp32 values into its masters unrounded, so from step 2 on it trained off stages 0-2 (a review:
    grad norm 3.2% off at step 20, 3.7e-4 here after 4 steps); now equal but for the grad norm's fp32 summation
    order (within 1e-7)."""
    for r in ranks(2).run(cases.stage3_matches_stage0, folder=hf_dir["llama"], units=["LlamaDecoderLayer"],
                          precision="bf16"):
        assert r["init_equal"] and r["changed"], r
        assert r["loss"] == r["params"] == 0.0 and r["grad_norm"] < 1e-6, r


# ------------------------------------------------------------------------------------------ zerorun train + consolidate --hf
@pytest.mark.slow
def test_train_then_consolidate_hf_reloads_bit_equal(tmp_path, hf_dir, monkeypatch):
    """One 2-rank `zerorun train` at stage 3 from the pretrained Llama on data kind hf (JSONL, the folder's BPE
    tokenizer); its checkpoint written as a HF folder (sharded: small --max-shard-size) reloads with
    from_pretrained bit-equal to the plain consolidated state, tokenizer files beside it."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "ckpt"
    data = {"kind": "hf", "path": hf_dir["jsonl"], "tokenizer": hf_dir["llama"], "seq_len": 16}
    path = _recipe(tmp_path / "r.yaml", {"hf": {"pretrained": hf_dir["llama"]}}, data,
                   zero={"stage": 3, "units": ["LlamaDecoderLayer"]}, launch={"procs_per_node": 2},
                   checkpoint={"dir": str(ckpt)}, log={"every": 1, "dir": str(tmp_path / "runs")})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    train = subprocess.run([sys.executable, "-m", "zerorun", "train", path, "--no-dashboard"], capture_output=True,
                           text=True, timeout=300, env=env, cwd=tmp_path)
    assert train.returncode == 0, train.stdout + train.stderr
    out = tmp_path / "export"
    from zerorun.cli import main

    for args in (["--out", str(out), "--hf", "--max-shard-size", "100KB"], ["--out", str(tmp_path / "full.safetensors")]):
        monkeypatch.setattr(sys, "argv", ["zerorun", "consolidate", str(ckpt), *args])
        main()  # in this process: returns on success, exits non-zero on an error
    files = sorted(os.listdir(out))
    assert "config.json" in files and "model.safetensors.index.json" in files, files
    umask = os.umask(0o022)
    os.umask(umask)
    for name in files + ["../full.safetensors"]:  # the umask's permissions, as open() gives (safetensors: 0600)
        assert os.stat(out / name).st_mode & 0o777 == 0o666 & ~umask, (name, oct(os.stat(out / name).st_mode))
    assert len([f for f in files if f.endswith(".safetensors")]) > 1, files
    assert "tokenizer.json" in files and "tokenizer_config.json" in files  # copied from data.tokenizer
    log = open(next((tmp_path / "runs" / "hf").glob("*/metrics.jsonl"))).read()
    assert "tokenized data.jsonl" in log  # the tokenizing progress reached the launcher
    assert os.path.isdir(hf_dir["jsonl"] + ".zerorun-tokens")  # cached beside the data
    index = json.load(open(out / "model.safetensors.index.json"))["weight_map"]
    assert "model.embed_tokens.weight" in index and "lm_head.weight" not in index  # tied weights once
    full = load_file(str(tmp_path / "full.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    state = model.state_dict()
    assert set(state) == {k[len("hf."):] for k in full}
    for key, value in full.items():
        assert torch.equal(state[key[len("hf."):]], value), key
    pretrained = AutoModelForCausalLM.from_pretrained(hf_dir["llama"]).state_dict()
    assert not torch.equal(pretrained["model.embed_tokens.weight"], state["model.embed_tokens.weight"])  # trained
    # a checkpoint is input: code its zerorun.json names (auto_map + trust_remote_code, a module in the
    # folder) is never imported by the export, which builds the architecture from model_type alone
    step = sorted(p for p in ckpt.iterdir() if p.name.startswith("step-"))[-1]
    evil = tmp_path / "evil" / step.name
    shutil.copytree(step, evil)
    pwned = tmp_path / "pwned"
    (evil / "evilmod.py").write_text(f"import pathlib\npathlib.Path({str(pwned)!r}).touch()\n"
                                     "from transformers import LlamaForCausalLM as Evil\n")
    info = json.loads((evil / "zerorun.json").read_text())
    trained = info["model_config"]  # the config it trained, saved with it: the export's, not the folder's now
    assert trained["model_type"] == "llama" and trained["tie_word_embeddings"] is True
    config = json.load(open(os.path.join(hf_dir["llama"], "config.json")))
    config.update(auto_map={"AutoModelForCausalLM": "evilmod.Evil"}, _name_or_path=str(evil))
    info["recipe"]["data"]["tokenizer"], tok_pwned = _custom_code_tokenizer(hf_dir, tmp_path)
    # twice: the saved config forged, the recipe's folder gone; then no saved config (an older checkpoint)
    for forged in ({**trained, "auto_map": config["auto_map"], "_name_or_path": str(evil)}, None):
        info["model_config"] = forged
        info["recipe"]["model"] = ({"hf": {"pretrained": str(tmp_path / "gone")}} if forged
                                   else {"hf": {"config": config}, "kwargs": {"trust_remote_code": True}})
        (evil / "zerorun.json").write_text(json.dumps(info))
        marker = json.loads((evil / "COMPLETE").read_text())  # the forger seals the edited zerorun.json too
        marker["sha256"] = hashlib.sha256((evil / "zerorun.json").read_bytes()).hexdigest()
        (evil / "COMPLETE").write_text(json.dumps(marker))
        monkeypatch.chdir(evil)
        monkeypatch.setattr(sys, "argv", ["zerorun", "consolidate", str(evil), "--out", str(tmp_path / "e"), "--hf"])
        main()
        assert not pwned.exists() and "evilmod" not in sys.modules
    # the tokenizer config is copied without auto_map, the folder's code is not copied, nothing imported
    exported = json.loads((tmp_path / "e" / "tokenizer_config.json").read_text())
    assert "auto_map" not in exported and exported == {k: v for k, v in json.loads(
        (tmp_path / "custom-tok" / "tokenizer_config.json").read_text()).items() if k != "auto_map"}
    assert not (tmp_path / "e" / "evil_tok.py").exists() and not tok_pwned.exists()
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "e")).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in state.items())


def test_hf_job_prints_before_importing_transformers(tmp_path, hf_dir):
    """Issue 37: an HF recipe's header (here --dry-run's commands) came 8-19 s late, after the launcher had
    imported torch and transformers to check the config and tokenizer; now those checks run after it (Note [HF
    checks after the header]): the model check stands in for the one the dry run starts."""
    recipe = _recipe(tmp_path / "r.yaml", {"hf": {"pretrained": hf_dir["llama"]}},
                     {"kind": "hf", "path": hf_dir["jsonl"], "tokenizer": hf_dir["tok"]})
    code = ("import sys\nfrom zerorun.rank import modelcheck\n"
            "class Check:\n    def wait(self, timeout=0):\n"
            "        print('imported:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
            "modelcheck.start = lambda *a, **k: Check()\n"
            f"sys.argv = ['zerorun', 'train', {recipe!r}, '--dry-run']\n"
            "from zerorun.cli import main\nmain()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# job ") and lines[-1] == "imported: []", out.stdout


@pytest.mark.slow
def test_hf_config_problem_found_by_the_model_check_is_one_line(tmp_path):
    """A config only transformers can judge (an unknown model_type) is found by the model check now (beside the
    launch; after a dry run's commands), not before the header: still one line naming the recipe's field, exit 2."""
    recipe = _recipe(tmp_path / "r.yaml", {"hf": {"config": {"model_type": "no-such-arch"}}})
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", recipe, "--dry-run"], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout.startswith("# job "), out.stdout + out.stderr
    assert out.stderr == f"zerorun: error: {recipe}:1: model.hf.config: unknown model_type 'no-such-arch' for this " \
                         "transformers version\n", out.stdout + out.stderr
