"""zerorun estimate: the ZeRO paper's numbers, the engine's own reports, activations, sizes and the CLI."""

import json
import math
import os
import re

import pytest
import torch

import estimate_cases as cases
from zerorun import estimate as est
from zerorun.errors import ZerorunError

FP32, BF16 = est.PRECISIONS["fp32"], est.PRECISIONS["bf16"]
ADAM = est.optimizer_model("adam")


def test_zero_paper_table_1():
    """ZeRO paper §5 / table 1: Ψ = 7.5B, N = 64, mixed precision Adam (K = 12): 120, 31.4, 16.6, 1.9 GB."""
    layout = est.layout_of_count(7_500_000_000)
    got = [est.model_states(layout, s, 64, BF16, ADAM).total for s in range(4)]
    psi = 7.5e9
    assert got == [16 * psi, 4 * psi + 12 * psi / 64, 2 * psi + 14 * psi / 64, 16 * psi / 64]
    # the paper rounds half up to 0.1 GB
    assert [math.floor(b / 1e8 + 0.5) / 10 for b in got] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("stage,formula", [
    (0, lambda p, n: 16 * p), (1, lambda p, n: 8 * p + 8 * p / n), (2, lambda p, n: 4 * p + 12 * p / n),
    (3, lambda p, n: 16 * p / n)])
def test_fp32_adam_formulas_of_the_design(stage, formula):
    layout = est.layout_of_count(1_000_000 * 24)
    for n in (1, 2, 3, 8):
        assert est.model_states(layout, stage, n, FP32, ADAM).total == formula(24_000_000, n)


def test_padding_rounds_each_buffer_up_to_the_world_size():
    layout = est.Layout(total=10, trainable=10, frozen=0, buffers=(7, 3), frozen_params=(), units=(), exact=True)
    s = est.model_states(layout, 2, 4, FP32, est.optimizer_model("none"))
    assert s.params == (8 + 4) * 4 and s.grads == (2 + 1) * 4


def test_communication_is_2psi_and_3psi_elements():
    """ZeRO paper §7: 2Ψ elements per rank per step at stages 0-2, 3Ψ at stage 3, times the ring's (N-1)/N."""
    psi, n = 64_000_000, 8
    layout = est.layout_of_count(psi)
    for stage, k in ((0, 2), (1, 2), (2, 2), (3, 3)):
        norm = 0 if stage == 0 else 2 * 7 / 8 * (24 if stage == 3 else 8)  # the fp64 grad-norm all-reduce (+ unit digest)
        assert est.comm_bytes(layout, stage, n, BF16) == round(k * psi * 2 * (n - 1) / n + norm)
    assert est.comm_bytes(layout, 3, 1, BF16) == 0


def engine_layout(config, stage, precision="fp32"):
    model, model_kwargs, units, _, opt_kwargs, bucket_mb, _, persistence = config
    with torch.device("meta"):
        m = cases.build(model, model_kwargs)
    return est.layout_of(m, bucket_mb=bucket_mb, units=units if stage == 3 else (), precision=precision,
                         persistence_threshold=persistence)


def assert_engine_reports(pool, stage, world_size, precision="fp32", reduce_dtype=None, offload="none",
                          offload_path=None, offload_params=False):
    reports = pool.run(cases.engine_reports, stage=stage, precision=precision, reduce_dtype=reduce_dtype,
                       offload=offload, offload_path=offload_path, offload_params="disk" if offload_params else "none")
    p = est.precision_of(precision, reduce_dtype)
    for i, config in enumerate(cases.CONFIGS):
        _, _, _, opt, opt_kwargs, _, accum, _ = config
        layout = engine_layout(config, stage, precision)
        # the ranks are CPU processes: the engine's "device" is the host (cpu offload keeps its bytes there)
        want = est.model_states(layout, stage, world_size, p, est.optimizer_model(opt, opt_kwargs), offload,
                                buffer_mb=cases.BUFFER_MB, device_is_host=True,
                                grad_accum_bytes=est.grad_accum_bytes(p, accum),  # zero.grad_accum_dtype unset
                                offload_params=offload_params)
        sent = est.comm_bytes(layout, stage, world_size, p, accum)
        # optimizer tensors are each rank's parts of parameters (padding in none): the estimate is the largest rank's
        assert max(r[i]["bytes"]["optimizer"] for r in reports) == want.optimizer, (stage, world_size, i)
        assert max(r[i]["offload"]["disk"] for r in reports) == want.disk, (stage, world_size, i)
        for rank, per_config in enumerate(reports):
            r = per_config[i]
            where = (f"stage {stage}, {world_size} ranks, {p.label}, offload {offload}, params offloaded "
                     f"{offload_params}, config {i}, rank {rank}")
            assert not r["skipped"], where
            assert r["bytes"] == {"params": want.params, "grads": want.grads + want.grad_accum,
                                  "optimizer": r["bytes"]["optimizer"]}, where
            assert r["bytes"]["optimizer"] <= want.optimizer and r["offload"]["disk"] <= want.disk, where
            assert r["offload"]["host"] == want.host, where
            # comm.py rounds each call; the first step's norm all-reduce also carries 48 bytes of records per
            # outer unit (Note [Outer units]), which estimate's steady step does not
            first = 2 * (world_size - 1) / world_size * 48 * r["outer_units"]
            assert abs(r["sent"] - first - sent) <= 8, (where, r["sent"], sent)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_predictions_equal_what_the_engine_reports(ranks, world_size, tmp_path):
    """Model-state bytes per rank equal ZeroEngine.memory_bytes() and offload_bytes() at every stage (padding
    included; optimizer and swap-file bytes: the largest rank's, which differ by padding and parameter cuts;
    frozen parameters, tied weights, several param groups, buckets and units), and bytes sent per
    step equal what zero/comm.py counts. Stronger than the 1% the estimate promises: the layout is the engine's
    own. fp32 on 1-4 ranks; on 2 and 3 ranks also bf16, fp16, zero.reduce_dtype fp32 and cpu/disk offload
    (estimate_cases.MODES), and stage 3 with its parameters offloaded to disk."""
    pool = ranks(world_size)
    for stage in range(4):
        assert_engine_reports(pool, stage, world_size)
        for precision, reduce_dtype, offload in cases.MODES.get(world_size, []):
            assert_engine_reports(pool, stage, world_size, precision, reduce_dtype, offload,
                                  str(tmp_path / "swap") if offload == "disk" else None)
    if world_size in cases.MODES:  # zero.offload_params disk (Note [Parameter offload]), optimizer disk / none
        assert_engine_reports(pool, 3, world_size, "fp32", None, "disk" if world_size == 2 else "none",
                              str(tmp_path / "swap"), offload_params=True)
    if world_size in cases.MODES:  # every engine was closed: no swap file is left
        assert [f for f in os.listdir(tmp_path / "swap") if not f.startswith(".")] == []


def test_layout_counts_and_largest_unit():
    with torch.device("meta"):
        m = cases.build("gpt", {})
    layout = est.layout_of(m, units=("Block",))
    assert layout.total == sum(p.numel() for p in m.parameters())
    assert layout.largest_unit.name == "blocks.0" and layout.largest_unit.numel == sum(
        p.numel() for p in m.blocks[0].parameters())
    with torch.device("meta"):
        frozen = cases.build("mlp", {"frozen": True})
    layout = est.layout_of(frozen)
    assert layout.frozen == 7 * 13 + 13 and layout.trainable + layout.frozen == layout.total


def test_activations_reduce_to_korthikanti_with_16_bit_and_dropout():
    """§4, eq. (1): s·b·h·(34 + 5·a·s/h) bytes per layer; full recomputation keeps 2·s·b·h per layer."""
    s, b, h, a, L, V = 2048, 4, 4096, 32, 24, 50000
    shape = {"n_layer": L, "d_model": h, "n_head": a, "seq_len": s, "vocab_size": V, "dropout": 0.1}
    got = est.activation_bytes(shape, micro_batch=b, element_bytes=2)
    assert got["per_layer"] == s * b * h * (34 + 5 * a * s / h)
    assert got["checkpointed"] - got["per_layer"] - got["output"] == 2 * s * b * h * L
    assert got["total_fused"] == got["total"] - L * 5 * a * s * s * b


@pytest.mark.parametrize("text,flag,value", [
    ("7B", "--params", 7 * 10**9), ("350M", "--params", 350 * 10**6), ("0.5B", "--largest-layer", 5 * 10**8),
    ("125000", "--params", 125000),
])
def test_parse_count(text, flag, value):
    assert est.parse_count(text, flag) == value


def test_parse_sizes_and_bandwidth():
    assert est.parse_bytes("80GiB") == 80 * 2**30 and est.parse_bytes("80GB") == 80 * 10**9
    assert est.parse_bytes("512 MiB") == 512 * 2**20
    assert est.parse_bandwidth("100Gbps") == 12.5e9 and est.parse_bandwidth("12.5GB/s") == 12.5e9


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


@pytest.mark.parametrize("flag,text,expected", [
    ("--params", "1e400", "'1e400' is too large"), ("--device-memory", "1e400GiB", "'1e400GiB' is too large"),
    ("--bandwidth", "1e400Gbps", "'1e400Gbps' is too large"), ("--params", "0.5", "expected a positive count"),
    ("--params", "1e-3", "expected a positive count"),
])
def test_sizes_out_of_range_are_one_line_errors(flag, text, expected):
    """1e400 parsed as inf and overflowed int() (a traceback); 0.5 parameters rounded to a model of 0."""
    parse = {"--params": est.parse_count, "--device-memory": est.parse_bytes, "--bandwidth": est.parse_bandwidth}
    with pytest.raises(ZerorunError, match=re.escape(f"{flag}: ") + ".*" + re.escape(expected)):
        parse[flag](text, flag)


def test_prefetch_bytes_bounds_the_gathered_working_set():
    """zero.prefetch_bytes: at most that many bytes of other listed units gathered ahead (Note [Prefetch]),
    never more than they all hold; unset: the next largest unit; 0 as prefetch off."""
    from zerorun.estimate.activations import working_set
    from zerorun.estimate.policies import PRECISIONS

    with torch.device("meta"):
        m = cases.build("gpt", {"n_layer": 4})
    layout = est.layout_of(m, units=("Block",))
    fp32 = PRECISIONS["fp32"]

    def gathered(**kw) -> int:
        return working_set(layout, 3, 2, fp32, **kw).gathered

    block = 4 * sum(-(-p.numel() // 2) * 2 for p in m.blocks[0].parameters())  # bytes, padded to 2 ranks
    one = gathered(prefetch=False)
    assert gathered() == one + block and gathered(prefetch_bytes=0) == one
    assert gathered(prefetch_bytes=block - 1) == one  # whole units only: none fits
    assert gathered(prefetch_bytes=2 * block + 5) == one + 2 * block
    assert gathered(prefetch_bytes=1 << 40) == one + 3 * block  # every other block, no more
    assert gathered(prefetch=False, prefetch_bytes=1 << 40) == one


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


def test_a_hosts_memory_probe_is_read_as_its_smallest_gpu_and_the_smallest_host():
    from zerorun.estimate.hosts import HostMemory, from_hosts, parse_probe

    a = parse_probe("a", "MemTotal:       2097152 kB\n81559\n40960\n")
    assert a == HostMemory(2 * 2**30, 40960 * 2**20, "cuda (nvidia-smi)")
    b = parse_probe("b", "MemTotal:       1048576 kB\n")  # no nvidia-smi: no GPU
    assert b.gpu_bytes is None
    m = from_hosts({"a": a, "b": b}, procs_per_node=2)
    assert (m.device, m.device_bytes, m.host_bytes) == ("cpu", 2**29, 2**30) and "no GPU on b" in m.source
    m = from_hosts({"a": a, "c": parse_probe("c", "MemTotal: 4194304 kB\n81559\n")}, procs_per_node=8)
    assert (m.device, m.device_bytes, m.host_bytes) == ("cuda (nvidia-smi)", 40960 * 2**20, 2 * 2**30)
    with pytest.raises(ZerorunError, match="d: cannot read its memory"):
        parse_probe("d", "sh: grep: not found\n")
