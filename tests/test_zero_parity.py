"""Every ZeRO stage trains to the same numbers as torch's DDP (fp32: within 1e-5 relative per step).

Note [Summation-order floor]: fp32 addition is not associative. Wherever ZeRO must add gradients in another
order than DDP (3 or more ranks with another bucket layout; stage 2, which reduces every micro-step instead
of accumulating locally first), Adam divides by sqrt(v) + eps and amplifies those ulp-level differences in
near-zero gradient elements (up to lr * δg / eps per step). Each case therefore also trains a second DDP that
differs from the first only in summation order (another ``bucket_cap_mb``, all-reduce on every micro-step,
the clipping norm summed over one flat vector instead of per parameter).
Losses and grad norms are held to 1e-5 at every step; final parameters to 1e-5, or to 4x the DDP-vs-DDP
distance measured in the same run where that floor is larger (measured: 0 for 2 ranks without accumulation,
so those cases are held to 1e-5; about 1e-4 for the tiny GPT under Adam at lr 1e-2 with 3 ranks).
"""

import pytest

import parity_cases as cases

TOL = 1e-5


def check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        param_tol = max(TOL, 4 * r["floor_params"])
        assert r["floor_params"] < 2e-3, f"rank {rank}: DDP-vs-DDP floor implausibly large: {r}"
        for key, tol in (("loss", TOL), ("grad_norm", TOL), ("params", param_tol), ("buffers", TOL)):
            assert r[key] <= tol, f"rank {rank}: {key} differs from DDP by {r[key]:.3g} relative ({r})"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_matches_ddp(ranks, world_size, stage, model):
    check(ranks(world_size).run(cases.parity, stage=stage, model=model))


def test_two_ranks_are_exact(ranks):
    """With 2 ranks and no accumulation the summation order cannot differ: no floor, 1e-5 everywhere."""
    for r in ranks(2).run(cases.parity, stage=1, model="gpt"):
        assert r["floor_params"] == 0.0 and r["params"] <= TOL, r


@pytest.mark.parametrize("stage", [1, 2])
def test_world_size_3_sgd_is_exact(ranks, stage):
    """Without Adam's 1/eps amplification, 3 ranks with padding hold 1e-5 on the parameters too."""
    check(ranks(3).run(cases.parity, stage=stage, model="gpt", optimizer="SGD",
                       optimizer_kwargs={"lr": 0.5, "momentum": 0.9, "weight_decay": 0.01}))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("accum,clip", [(3, None), (1, 0.05), (2, 0.05)])
@pytest.mark.parametrize("model,world_size", [("gpt", 2), ("mlp", 3)])
def test_accumulation_and_clipping(ranks, stage, accum, clip, model, world_size):
    check(ranks(world_size).run(cases.parity, stage=stage, model=model, accum=accum, clip=clip))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("structure", [
    {"frozen": True},
    {"branch": True, "branch_pattern": "mixed"},
    {"batchnorm": True},
    {"groups": "custom"},
], ids=["frozen", "unused-branch", "batchnorm", "param-groups"])
def test_structures(ranks, stage, structure):
    check(ranks(3).run(cases.parity, stage=stage, model="mlp", **structure))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer,kwargs", [
    ("Adam", {"lr": 1e-2}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    ("Adagrad", {"lr": 0.05}),
])
def test_optimizers(ranks, stage, optimizer, kwargs):
    check(ranks(2).run(cases.parity, stage=stage, optimizer=optimizer, optimizer_kwargs=kwargs))


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_embedding(ranks, tie):
    """The GPT's LM head shares the token embedding: one parameter, reduced once, still equal to DDP."""
    check(ranks(2).run(cases.parity, stage=2, model="gpt", tie_embeddings=tie))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_reported_bytes_match_zero_paper(ranks, world_size, stage):
    """ZeRO §5, fp32 AdamW: stage 0 16Ψ; stage 1 4Ψ + 4Ψ + 8Ψ/N; stage 2 4Ψ + 12Ψ/N (Ψ with padding)."""
    for r in ranks(world_size).run(cases.memory, stage=stage):
        n, padded = r["world_size"], r["padded"]
        expected = {0: (4 * padded, 4 * padded, 8 * padded),
                    1: (4 * padded, 4 * padded, 8 * padded // n),
                    2: (4 * padded, 4 * padded // n, 8 * padded // n)}[stage]
        got = r["bytes"]
        assert (got["params"], got["grads"]) == expected[:2]
        # plus one 4-byte step counter per optimizer tensor (AdamW keeps 'step' as a tensor)
        assert expected[2] <= got["optimizer"] <= expected[2] + 4 * 64
        assert 0 <= padded - r["psi"] < n * 64  # at most N-1 padding elements per flat buffer


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bytes_sent_per_step(ranks, stage):
    """Ring collectives, ZeRO §7: stage 0 all-reduce, stages 1-2 reduce-scatter + all-gather: 2Ψ(N-1)/N x 4 bytes
    (plus the 4-byte global-norm all-reduce at stages 1-2)."""
    for r in ranks(3).run(cases.memory, stage=stage):
        n, padded = r["world_size"], r["padded"]
        expected = 2 * padded * (n - 1) // n * 4
        extra = 0 if stage == 0 else round(2 * (n - 1) / n * 4)
        assert r["comm"]["bytes_sent"] == expected + extra
