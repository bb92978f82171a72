"""torch.compile at every ZeRO stage (Note [Compiling per unit] in zerorun/zero/compiling.py): a compiled model
trains as the same model uncompiled at the same stage (fp32, within 1e-5 relative per step), stage 3 compiles
each unit's forward without recompiling per step or per gather, and ``model.compile`` in a recipe trains."""

import json
import os
import subprocess
import sys

import pytest

import compile_cases as cases

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


def check(r: dict, stage: int) -> None:
    for key in ("loss", "grad_norm", "params", "eval"):
        assert r[key] <= TOL, f"stage {stage}: {key} differs from the uncompiled run by {r[key]:.3g} relative"
    # the state dict is the model's own: no "_orig_mod." prefix (before: every key had it at stages 0-2)
    assert r["keys"] == r["plain_keys"], (r["keys"][:3], r["plain_keys"][:3])
    # dynamo compiled in the first step only: no recompile per step or per gather, no graph break
    first, last = r["counts"][0], r["counts"][-1]
    assert first["graphs"] >= 1 and last["graphs"] == first["graphs"], r["counts"]
    assert last["graph_breaks"] == 0, r["counts"]
    assert not [w for w in r["warnings"] if "outside its unit" in w], r["warnings"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_compiled_model_trains_as_uncompiled_at_every_stage(ranks, stage):
    """``initialize(torch.compile(model, backend="aot_eager"))``. Before: stage 3 raised RecursionError inside
    its hooks after "used outside its unit" warnings; stages 0-2 trained, their state dict keyed
    ``_orig_mod.*``."""
    for r in ranks(2).run(cases.compiled_parity, stage=stage):
        check(r, stage)
        if stage == 3:  # both blocks share one graph: one compile for the unit class
            assert r["counts"][0]["graphs"] == 1, r["counts"]


def test_stage_3_with_inductor(ranks):
    """Inductor (C++ kernels on the CPU) at stage 3; its first step compiles (about 15 s on 2 loaded cores).
    SGD: inductor's fused kernels sum in another order, and Adam turns those ulp-level gradient differences
    into lr-sized steps in elements whose gradient is near zero (Note [Summation-order floor] in
    test_zero_parity.py). Measured with AdamW: parameters 3.0e-4 relative apart after 4 steps at stage 0 (the
    whole model compiled, no stage-3 code) and 3.7e-4 at stage 3, loss and grad norm within 1.2e-7 at both;
    with SGD the parameters are 5.7e-7 apart."""
    for r in ranks(2).run(cases.compiled_parity, stage=3, backend="inductor", steps=4, optimizer="SGD"):
        check(r, 3)


@pytest.mark.parametrize("kwargs", [dict(activation_checkpointing=True), dict(units=()),
                                    dict(how="inside")], ids=["checkpointing", "automatic-units", "inside-a-unit"])
def test_stage_3_compiled_variants(ranks, kwargs):
    """Activation checkpointing (the checkpointed forward compiled), units picked by parameter count, and a
    module inside a unit compiled in place by the user."""
    for r in ranks(2).run(cases.compiled_parity, stage=3, **kwargs):
        check(r, 3)


def test_stage_3_compiles_again_for_a_new_shape_only(ranks):
    """A shorter sequence from step 3 on compiles once more (dynamo's automatic dynamic shapes), while the outer
    units' saved-tensor hooks are active (Note [Outer units]), and never again: the numbers stay uncompiled's."""
    for r in ranks(2).run(cases.compiled_parity, stage=3, shorter_from=2):
        assert [c["graphs"] for c in r["counts"]] == [1, 1, 2, 2, 2], r["counts"]
        assert r["counts"][-1]["graph_breaks"] == 0 and max(r[k] for k in ("loss", "grad_norm", "params")) <= TOL, r


@pytest.mark.parametrize("target,named", [("model", "the model"), ("block", "module 'blocks.0'")])
def test_stage_3_refuses_a_unit_compiled_in_place(ranks, target, named):
    """``model.compile()`` (or a unit's) would trace the units' hooks: one line naming the module and
    ``torch.compile(model, ...)``, before anything is partitioned."""
    for message in ranks(2).run(cases.in_place_refused, target=target):
        assert message.startswith(f"stage 3: {named} was compiled in place"), message
        assert "torch.compile(model, backend=...)" in message and message.endswith("untouched=True"), message
        assert "\n" not in message


def _train(tmp_path, *overrides: str) -> list[dict]:
    runs = tmp_path / "runs"
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", os.path.join(ROOT, "recipes/tiny.yaml"),
                          f"log.dir={runs}", "train.steps=6", "log.every=1", "train.eval_every=0", "zero.stage=3",
                          "zero.units=[Block]", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    [metrics] = list(runs.glob("*/*/metrics.jsonl"))
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_recipe_model_compile_trains_at_stage_3(tmp_path):
    """``zerorun train recipes/tiny.yaml model.compile=aot_eager`` at stage 3: the losses of the uncompiled run."""
    plain = _train(tmp_path / "plain")
    compiled = _train(tmp_path / "compiled", "model.compile=aot_eager")
    losses = [[e["loss"] for e in events if e["event"] == "step" and e["rank"] == 0] for events in (plain, compiled)]
    assert len(losses[0]) == 6 and len(losses[1]) == 6
    for a, b in zip(*losses):
        assert abs(b - a) <= TOL * abs(a), losses
    logged = [e["message"] for e in compiled if e["event"] == "log" and "model.compile" in e.get("message", "")]
    assert logged == ["model.compile: aot_eager compiles each unit's forward (the code between units runs eagerly); "
                      "the first step compiles"], logged
