"""Which optimizers run over ZeRO's flat slices (Note [Elementwise optimizers] in zero/optimizers.py): the
checked torch.optim classes train exactly as per parameter; anything else is refused with one line naming the
class and the way out, unless declared elementwise."""

import pytest
import torch

import optimizer_cases as cases
from zerorun import estimate as est
from zerorun.errors import ZerorunError
from zerorun.recipe import load_recipe
from zerorun.zero import resolve_optimizer
from zerorun.zero.optimizers import ELEMENTWISE_OPTIMIZERS, WAY_OUT

from test_recipe import good

TOL = 1e-5


def test_the_cases_cover_every_allowed_class():
    assert {getattr(torch.optim, name) for name, _ in cases.ALLOWED} == set(ELEMENTWISE_OPTIMIZERS)


@pytest.mark.parametrize("name,kwargs", cases.ALLOWED)
def test_zerorun_estimate_models_every_allowed_class_exactly(name, kwargs):
    """Per-element state tensors and scalar state bytes after one step, as torch keeps them (ASGD was missing)."""
    p = torch.zeros(3, requires_grad=True)
    opt = getattr(torch.optim, name)([p], **kwargs)
    p.grad = torch.ones(3)
    opt.step()
    tensors = [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    model = est.optimizer_model(name, kwargs)
    assert model.states == sum(v.shape == p.shape for v in tensors)
    assert model.scalar_bytes == sum(v.nbytes for v in tensors if v.shape != p.shape)


@pytest.mark.parametrize("cls", [cases.TrustRatio, cases.RenamedAdamW])
def test_unchecked_classes_are_refused_naming_the_way_out(cls):
    with pytest.raises(ValueError) as e:
        resolve_optimizer(cls)
    msg = str(e.value)
    assert "\n" not in msg and f"optimizer optimizer_cases.{cls.__name__} " in msg and WAY_OUT in msg
    assert resolve_optimizer(cls, elementwise=True) is cls


@pytest.mark.parametrize("name", ["LBFGS", "SparseAdam", "Adafactor", "Muon"])
def test_known_non_elementwise_classes_are_refused_even_when_declared(name):
    if not hasattr(torch.optim, name):
        pytest.skip(f"torch.optim.{name} does not exist in this torch")
    for declared in (False, True):
        with pytest.raises(ValueError, match=f"^optimizer {name} is not elementwise"):
            resolve_optimizer(name, elementwise=declared)


def test_recipe_declares_elementwise_without_passing_it_to_the_optimizer(tmp_path):
    r = load_recipe(good(tmp_path), ["train.optimizer.elementwise=true"])
    assert r.train.optimizer.elementwise is True and "elementwise" not in r.train.optimizer.kwargs()
    with pytest.raises(ZerorunError, match=r"train\.optimizer\.name: optimizer Adafactor is not elementwise"):
        load_recipe(good(tmp_path), ["train.optimizer.name=Adafactor", "train.optimizer.elementwise=true"])


def test_every_allowed_class_trains_as_per_parameter(ranks):
    """Stages 0 and 2 (2 KiB buckets: slices cut parameters) against a per-parameter optimizer over
    all-reduced gradients, 7 steps, every allowed class and a user's class declared elementwise."""
    results = ranks(2).run(cases.allowed_equal_per_parameter)
    for rank, res in enumerate(results):
        assert set(res) == {name for name, _ in cases.ALLOWED} | {"PlainSGD"}
        for name, distances in res.items():
            assert max(distances) <= TOL, f"rank {rank}: {name} at stages 0/2 differs by {distances}"


def test_initialize_refuses_undeclared_and_runs_declared(ranks):
    for res in ranks(2).run(cases.refusals):
        for name in ("TrustRatio", "RenamedAdamW"):
            assert res[name] is not None and name in res[name] and "elementwise=True" in res[name], res
        assert res["declared_renamed_adamw"] <= TOL, res


@pytest.mark.parametrize("stage", [0, 2])
def test_a_tensor_lr_trains_as_a_float_one(ranks, stage):
    """The engine chose ``foreach=True`` where the user chose nothing, and torch refuses a tensor ``lr`` there: the
    error named an option the user never set (found by review). torch's default path takes it, as in plain
    PyTorch."""
    assert max(ranks(2).run(cases.tensor_lr, stage=stage)) <= 1e-6
