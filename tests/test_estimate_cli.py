"""zerorun estimate on the command line: flags, their one-line errors, a recipe or a hostfile as input, what
the first line says and the layout of the printed table (the formulas and the engine's own reports are in
tests/test_estimate.py)."""

import json
import os

import pytest
import torch

from zerorun import estimate as est

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TINY, _LOCAL2 = os.path.join(_ROOT, "recipes", "tiny.yaml"), os.path.join(_ROOT, "hostfiles", "localhost-2")


@pytest.mark.parametrize("args,expected", [
    (["--params", "7X"], "zerorun: error: --params: cannot read '7X'"),
    (["--params", "7B", "--device-memory", "lots"], "zerorun: error: --gpu-memory: cannot read 'lots'"),
    # a bare number was read as bytes ("fits: no -1717800%"); an empty value was ignored
    (["--params", "7B", "--gpu-memory", "80"],
     "zerorun: error: --gpu-memory: cannot read '80': expected a positive size such as 80GiB"),
    (["--params", "7B", "--host-memory", ""], "zerorun: error: --host-memory: cannot read ''"),
    (["--params", "7B", "--bandwidth", "100Gb"], "zerorun: error: --bandwidth: cannot read '100Gb'"),
    (["--params", "7B", "--largest-layer", "-1"], "zerorun: error: --largest-layer: cannot read '-1'"),
    (["--params", "7B", "--precision", "fp8"], "zerorun: error: --precision: 'fp8' is not one of"),
    (["--params", "7B", "--optimizer", "LBFGS"], "zerorun: error: --optimizer: no memory model for optimizer"),
    ([], "zerorun: error: estimate: give a recipe file or --params"),
    # were accepted: a largest layer larger than the model, and one beside a recipe (ignored)
    (["--params", "1B", "--largest-layer", "2B"],
     "zerorun: error: --largest-layer: 2B is more parameters than the whole model (--params 1B)"),
    (["recipes/tiny.yaml", "--largest-layer", "1M"], "zerorun: error: --largest-layer: only with --params"),
    # 7.5 was rounded to 8 parameters; 1e30 printed "1e+18T" parameters and a headroom of -6e22 %; neither a
    # recipe nor --params said "(not both)"
    (["--params", "7.5"], "zerorun: error: --params: '7.5' is not a whole number of parameters (with a unit: 7.5B"),
    (["--params", "1e30"], "zerorun: error: --params: '1e30' is more than 1,000T parameters"),
    (["--largest-layer", "1B"], "zerorun: error: estimate: give a recipe file or --params\n"),
    (["--params", "7B", "--largest-layer", ""], "zerorun: error: --largest-layer: cannot read ''"),  # was ignored
    (["recipes/tiny.yaml", "--params", "1B"], "zerorun: error: estimate: give a recipe file or --params, not both"),
    # ran for minutes in 11 GB, and raised MemoryError with a traceback
    (["--params", "7B", "--nodes", "100000000"], "zerorun: error: --nodes 100000000: more than 100,000 nodes\n"),
    (["--params", "7B", "--nodes", "100000000000", "--procs-per-node", "100000000"],
     "zerorun: error: --nodes 100000000000: more than 100,000 nodes\n"),
    (["--params", "7B", "--procs-per-node", "100000000"],
     "zerorun: error: --procs-per-node 100000000: more than 4,096 ranks per node\n"),
    (["--params", "7B", "--nodes", "100000", "--procs-per-node", "11"],
     "zerorun: error: --nodes 100000 x --procs-per-node 11: 1,100,000 ranks, more than 1,000,000\n"),
    # a layout the hostfile cannot launch (zerorun train refuses it) was planned (found by review)
    ([_TINY, "-H", _LOCAL2, "--procs-per-node", "3"],
     "zerorun: error: --procs-per-node 3: host localhost has only 2 slot(s)\n"),
    ([_TINY, "-H", _LOCAL2, "--nodes", "3"], "zerorun: error: --nodes 3: only 1 host(s) selected\n"),
])
def test_bad_flags_are_one_line_exit_2(capsys, monkeypatch, args, expected):
    from zerorun import cli

    monkeypatch.setattr("sys.argv", ["zerorun", "estimate", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(expected) and err.count("\n") == 1, err


def run_cli(capsys, monkeypatch, *args):
    from zerorun import cli

    monkeypatch.setattr("sys.argv", ["zerorun", "estimate", *args])
    cli.main()
    return capsys.readouterr().out


def test_setup_line_counts_nodes_in_words(capsys, monkeypatch):
    out = run_cli(capsys, monkeypatch, "--params", "1B", "--procs-per-node", "2")
    assert "2 ranks (1 node x 2)" in out, out
    out = run_cli(capsys, monkeypatch, "--params", "1B", "--procs-per-node", "2", "--nodes", "3")
    assert "6 ranks (3 nodes x 2)" in out, out
    out = run_cli(capsys, monkeypatch, "--params", "1B", "--procs-per-node", "1")
    assert "1 rank (1 node x 1)" in out, out


def test_setup_line_of_a_hostfile_with_uneven_slots(capsys, monkeypatch, tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=3\n127.0.0.1 slots=1\n")
    out = run_cli(capsys, monkeypatch, "recipes/tiny.yaml", "-H", str(tmp_path / "hosts"))
    assert "4 ranks (2 nodes, up to 3 per node)" in out, out
    # the layout zerorun train launches on it (found by review: --nodes 2 planned 2 x 3 = 6 ranks)
    out = run_cli(capsys, monkeypatch, "recipes/tiny.yaml", "-H", str(tmp_path / "hosts"), "--nodes", "2")
    assert "4 ranks (2 nodes, up to 3 per node)" in out, out
    out = run_cli(capsys, monkeypatch, "recipes/tiny.yaml", "-H", str(tmp_path / "hosts"), "--procs-per-node", "1")
    assert "2 ranks (2 nodes x 1)" in out, out


def test_recipe_with_hostfile_as_json(capsys, monkeypatch, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=3\n127.0.0.1 slots=1\n")
    out = json.loads(run_cli(capsys, monkeypatch, "recipes/tiny.yaml", "train.micro_batch_size=2", "-H",
                             str(hostfile), "--device-memory", "1GiB", "--cpu-memory", "8GiB", "--json"))
    assert out["setup"]["world_size"] == 4 and out["setup"]["nodes"] == 2 and out["setup"]["procs_per_node"] == 3
    assert [r["label"] for r in out["stages"]][:4] == ["0", "1", "2", "3"]
    assert out["params"]["largest_unit"]["name"].startswith("blocks.")
    acts = out["activations"]
    # the built-in GPT declares fused attention (F.scaled_dot_product_attention): no attention scores kept
    assert acts["fused_attention"] and out["stages"][0]["activations"] == acts["total_fused"]
    assert acts["total"] > acts["total_fused"] > acts["checkpointed_fused"] > 0
    assert out["recommendation"].startswith("stage 0:")
    s3 = out["stages"][3]
    # Note [Peak]: activations are freed in backward as gradient buckets fill
    assert s3["device_total"] == s3["model_states"] + s3["gathered"] + max(s3["activations"], s3["backward_transient"])
    assert s3["gathered"] > 0 and out["stages"][2]["gathered"] == 0


def test_seventy_billion_on_meta_and_what_to_change(capsys, monkeypatch, tmp_path):
    """A 70B-parameter GPT costs no memory to count; on 8 x 80 GiB no stage without offload fits, and the
    recommendation says how many nodes stage 3 needs."""
    recipe = tmp_path / "big.yaml"
    recipe.write_text("""name: big
model:
  module: %s
  kwargs: {vocab_size: 32000, n_layer: 80, n_head: 64, d_model: 8192, max_seq_len: 4096}
data: {kind: text, paths: ["{stdlib}/json/*.py"], seq_len: 4096}
train: {steps: 1, micro_batch_size: 1}
""" % (est.__file__.rsplit("/zerorun/", 1)[0] + "/recipes/models/gpt.py"))
    out = json.loads(run_cli(capsys, monkeypatch, str(recipe), "--precision", "bf16", "--procs-per-node", "8",
                             "--device-memory", "80GiB", "--cpu-memory", "4TiB", "--json", "--optimizer", "adam"))
    assert 64e9 < out["params"]["total"] < 70e9
    assert not any(r["fits"] for r in out["stages"] if r["offload"] == "none")
    # automatic units leave the 80 blocks (1/80 of the model each) in the root unit, gathered whole
    assert "make smaller units, e.g. zero.units: [Block]" in out["recommendation"]
    out = json.loads(run_cli(capsys, monkeypatch, str(recipe), "zero.units=[Block]", "zero.stage=3", "--precision",
                             "bf16", "--procs-per-node", "8", "--device-memory", "80GiB", "--cpu-memory", "4TiB",
                             "--json"))
    assert "stage 3 with train.activation_checkpointing fits on 2 nodes (16 ranks)" in out["recommendation"]
    # every rank builds the model in fp32 host memory before moving it to its device: 8 x 260 GB per node
    out = json.loads(run_cli(capsys, monkeypatch, str(recipe), "zero.units=[Block]", "zero.stage=3",
                             "train.activation_checkpointing=true", "--precision", "bf16", "--procs-per-node", "8",
                             "--device-memory", "80GiB", "--cpu-memory", "1TiB", "--json"))
    assert all(r["cpu_per_node"] >= 8 * 4 * out["params"]["total"] for r in out["stages"])
    assert "host memory per node (have 1.00 TiB)" in out["recommendation"]
    text = run_cli(capsys, monkeypatch, str(recipe), "--precision", "bf16", "--procs-per-node", "8",
                   "--device-memory", "80GiB", "--cpu-memory", "4TiB")
    assert "Recommendation" in text and "Korthikanti" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="detects a CUDA device instead")
def test_cpu_only_machine_uses_host_memory_per_rank(capsys, monkeypatch):
    import psutil

    out = json.loads(run_cli(capsys, monkeypatch, "--params", "350M", "--procs-per-node", "2", "--json"))
    host = psutil.virtual_memory().total
    assert out["setup"]["device"] == "cpu" and out["setup"]["device_memory"] == host // 2
    # disk offload is offered (the engine runs it on CPU); cpu offload would move nothing off this "device"
    assert [r["label"] for r in out["stages"]] == ["0", "1", "2", "3"] + [f"{s} + offload disk" for s in range(4)] + [
        "3 + offload disk+params"]
    assert any("no cpu-offload rows" in n for n in out["notes"])
    for none, disk in zip(out["stages"][:4], out["stages"][4:]):
        assert disk["optimizer"] == 0 and disk["offload_disk"] > none["optimizer"] and disk["offload_host"] > 0
        # the paging buffer is host memory, which is this machine's device memory
        assert disk["device_total"] == none["device_total"] - none["optimizer"] + disk["offload_host"]
        assert disk["disk_per_node"] == 2 * disk["offload_disk"]
    assert out["stages"][0]["cpu_per_node"] == 2 * out["stages"][0]["device_total"]
    # gloo's pending reduce-scatters receive their buckets: at stage 1 all of them, at the end of backward (on
    # 2 ranks the other rank's half of each)
    assert out["stages"][1]["backward_transient"] == out["stages"][1]["grads"] // 2


def test_recipe_gives_precision_and_offload_unless_flags_override(capsys, monkeypatch, tmp_path):
    """`zerorun estimate recipe.yaml` estimates the recipe's precision, zero.reduce_dtype, zero.offload_optimizer
    and zero.offload_buffer_mb; --precision and --offload override them; a recipe that does not choose an
    offload gets every variant. On an accelerator cpu offload moves masters and states to host memory."""
    from zerorun.recipe import load_recipe

    recipe = ["recipes/tiny.yaml", "precision=bf16", "zero.reduce_dtype=fp32", "zero.offload_optimizer=disk",
              f"zero.offload_path={tmp_path}", "zero.offload_buffer_mb=0.5"]
    flags = ["--device-memory", "1GiB", "--cpu-memory", "8GiB", "--json"]
    out = json.loads(run_cli(capsys, monkeypatch, *recipe, *flags))
    s = out["setup"]
    assert (s["precision"], s["reduce_dtype"], s["offload"], s["offload_buffer_mb"]) == ("bf16", "fp32", "disk", 0.5)
    assert [r["label"] for r in out["stages"]] == [str(s) for s in range(4)] + [
        f"{s} + offload disk" for s in range(4)] + ["3 + offload disk+params"]  # zero.offload_params disk too
    layout = est.layout_of_recipe(load_recipe(recipe[0], recipe[1:]))
    adamw = est.optimizer_model("AdamW")
    bf16_fp32 = est.precision_of("bf16", "fp32")
    for r in out["stages"]:
        want = est.model_states(layout, r["stage"], 2, bf16_fp32, adamw, r["offload"].removesuffix("+params"),
                                buffer_mb=0.5, offload_params=r["offload"].endswith("params"))
        got = (r["params"], r["grads"], r["optimizer"], r["offload_host"], r["offload_disk"])
        assert got == (want.params, want.grads, want.optimizer, want.host, want.disk), r["label"]
    offloaded = out["stages"][-1]  # the parameter slices move to disk, in whole pages
    assert offloaded["params"] == 0 and offloaded["offload_disk"] > out["stages"][7]["offload_disk"]

    # a recipe with zero.offload_params disk and no optimizer offload gets its own row
    params_only = ["recipes/tiny.yaml", "zero.stage=3", "zero.offload_optimizer=none", "zero.offload_params=disk",
                   f"zero.offload_path={tmp_path}"]
    rows = json.loads(run_cli(capsys, monkeypatch, *params_only, *flags))["stages"]
    assert [r["label"] for r in rows] == [str(s) for s in range(4)] + ["3 + offload params"]
    assert rows[-1]["params"] == 0 and rows[-1]["offload_disk"] >= rows[3]["params"] and rows[-1]["optimizer"] == \
        rows[3]["optimizer"]
    # 2-byte parameters, gradients reduced and kept in fp32 at stage 2, fp32 master beside AdamW's states
    padded = sum(n + n % 2 for n in layout.buffers)
    assert (out["stages"][2]["params"], out["stages"][2]["grads"]) == (2 * padded, 4 * padded // 2)

    out = json.loads(run_cli(capsys, monkeypatch, *recipe, "--precision", "fp32", "--offload", "cpu", *flags))
    assert (out["setup"]["precision"], out["setup"]["offload"]) == ("fp32", "cpu")
    assert [r["offload"] for r in out["stages"]] == ["none"] * 4 + ["cpu"] * 4
    fp32_layout = est.layout_of_recipe(load_recipe(recipe[0], recipe[1:]), "fp32")
    for none, cpu in zip(out["stages"][:4], out["stages"][4:]):
        stage = cpu["stage"]
        bufs = [n for u in fp32_layout.units for n in u.trainable] if stage == 3 else fp32_layout.buffers
        elements = sum(n + n % 2 for n in bufs) // (1 if stage == 0 else 2)  # what this rank's optimizer updates
        # the host keeps a separate fp32 master even at fp32 (on the device the parameters were their own)
        assert cpu["optimizer"] == 0 and cpu["offload_host"] == none["optimizer"] + 4 * elements, cpu["label"]
        assert cpu["cpu_per_node"] >= 2 * cpu["offload_host"] and cpu["disk_per_node"] == 0

    out = json.loads(run_cli(capsys, monkeypatch, "recipes/tiny.yaml", *flags))
    assert out["setup"]["offload"] == "all" and out["setup"]["precision"] == "fp32"
    assert [r["offload"] for r in out["stages"]] == ["none"] * 4 + ["cpu"] * 4 + ["disk"] * 4 + ["disk+params"]
    out = json.loads(run_cli(capsys, monkeypatch, "recipes/tiny.yaml", "--offload", "none", *flags))
    assert [r["offload"] for r in out["stages"]] == ["none"] * 4


def test_bad_offload_flag_is_one_line_exit_2(capsys, monkeypatch):
    from zerorun import cli

    monkeypatch.setattr("sys.argv", ["zerorun", "estimate", "--params", "7B", "--offload", "nvme"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("zerorun: error: --offload: 'nvme' is not one of") and \
        err.count("\n") == 1, err


def test_piped_output_follows_columns(capsys, monkeypatch):
    """Into a pipe the estimate is laid out in 120 columns, or in ``$COLUMNS`` when set (it was 120 whatever
    COLUMNS said: rich reads COLUMNS for a terminal only)."""
    args = ("--params", "7B", "--nodes", "2", "--procs-per-node", "8")
    widths = {}
    for columns in (None, "200", "80"):
        if columns is None:
            monkeypatch.delenv("COLUMNS", raising=False)
        else:
            monkeypatch.setenv("COLUMNS", columns)
        widths[columns] = max(len(line) for line in run_cli(capsys, monkeypatch, *args).splitlines())
    assert widths[None] <= 120 < widths["200"] <= 200 and widths["80"] <= 80, widths


def test_memory_from_the_flags_or_this_machine_said_on_the_first_line(capsys, monkeypatch):
    """Issue 37 part 6: ``--gpu-memory``/``--host-memory`` (aliases of ``--device-memory``/``--cpu-memory``)
    and the first line says whose memory the stages are fitted into; ``--host-memory`` alone on a CPU-only
    machine is shared by the node's ranks (it was this machine's memory per rank)."""
    out = run_cli(capsys, monkeypatch, "--params", "1B", "--gpu-memory", "80GiB", "--host-memory", "1TiB")
    assert out.splitlines()[0] == "Memory from --gpu-memory and --host-memory: device given 80.00 GiB per rank, " \
                                  "host 1.00 TiB per node", out
    out = json.loads(run_cli(capsys, monkeypatch, "--params", "1B", "--procs-per-node", "4", "--host-memory",
                             "64GiB", "--json"))["setup"]
    assert out["cpu_memory_per_node"] == 64 * 2**30
    if out["device"] == "cpu":
        assert out["device_memory"] == 16 * 2**30 and out["memory_source"] == "--host-memory and this machine (localhost)"
    out = run_cli(capsys, monkeypatch, "--params", "1B")
    assert out.splitlines()[0].startswith("Memory from this machine (localhost): "), out


@pytest.mark.parametrize("body,code,expected", [
    ("import sys; sys.exit(3)", 2, "models.py: build_model(**{}) raised SystemExit: 3 (a factory that parses the "
                                   "command line or exits cannot build the model here)\n"),
    ("import argparse; argparse.ArgumentParser().parse_args()", 2,
     "models.py: build_model(**{}) raised SystemExit: 2 (a factory that parses"),
    ("raise KeyboardInterrupt", 130, "interrupted\n"),
    ("raise GeneratorExit", 2, "models.py: build_model(**{}) raised GeneratorExit: \n"),
])
def test_a_factory_that_exits_is_one_line(capsys, monkeypatch, tmp_path, body, code, expected):
    """Found by review: a factory calling sys.exit (or argparse's parse_args) made estimate exit with its code and
    no line, and a Ctrl-C inside it exited 130 silently; zerorun train said one line for both."""
    from zerorun import cli

    (tmp_path / "models.py").write_text(f"def build_model():\n    {body}\n")
    (tmp_path / "r.yaml").write_text("name: x\nmodel: {module: models.py, factory: build_model}\n"
                                     "data: {kind: text, paths: ['{stdlib}/json/*.py'], seq_len: 8}\n"
                                     "train: {steps: 2, micro_batch_size: 2}\n")
    monkeypatch.setattr("sys.argv", ["zerorun", "estimate", str(tmp_path / "r.yaml")])
    with pytest.raises(SystemExit) as e:
        cli.main()
    err = capsys.readouterr().err.splitlines(keepends=True)[-1]
    assert e.value.code == code and err.startswith("zerorun: error: ") and expected in err, err
