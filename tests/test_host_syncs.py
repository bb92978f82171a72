"""Host syncs in steady micro-steps and in stage 3's step extras (issue 33 item 3; tests/host_syncs.py counts
zerorun's own ``.item()/bool()/int()/float()/tolist()`` reads, the CPU stand-in for a GPU stall).

Bounds held here, per steady step of 2 micro-steps (the optimizer's own step at stages 0-2 is
tests/test_step_syncs.py's):
- forward: 0 at every stage; backward of a micro-step that does not end the step: 0 at stages 0-2.
- the step's last backward: 1, the ranks' agreement on unused parameters and late gradients (Note
  [Per-parameter readiness] in reducer.py; it was 1 per reducing backward: 2 per step at stages 2-3).
- stage 3: 1 per backward more, the check that every rank's backward reaches the same units (Note [Backward
  on some ranks] in stage3_checks.py: before backward, against a hang); in the step, 1 from its files (Note
  [Same units on every rank]: verdict and sums in one read, were 3).
"""

import pytest

import host_sync_cases as cases

COMBOS = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]
OWN = ("zerorun/zero/reducer.py", "zerorun/zero/stage3", "zerorun/zero/units.py", "zerorun/zero/comm.py",
       "zerorun/zero/streams.py", "zerorun/zero/deferred.py", "zerorun/zero/policy.py")


def _where(sites: dict, file: str) -> int:
    return sum(n for site, n in sites.items() if site.startswith(file))


@pytest.mark.slow
def test_steady_micro_steps_read_nothing_but_the_agreements(ranks):
    for rank, result in enumerate(ranks(2).run(cases.steady_reads, combos=COMBOS)):
        for stage, precision in COMBOS:
            phases = result[f"{stage}/{precision}"]
            where = f"rank {rank}, stage {stage} {precision}: {phases}"
            assert phases["forward0"] == {} and phases["forward1"] == {}, where
            checks = 1 if stage == 3 else 0  # Note [Backward on some ranks]
            assert sum(phases["backward0"].values()) == checks, where
            assert _where(phases["backward0"], "zerorun/zero/stage3_checks.py") == checks, where
            assert sum(phases["backward1"].values()) == checks + 1, where
            assert _where(phases["backward1"], "zerorun/zero/reducer.py") == 1, where
            own = {site: n for site, n in phases["step"].items() if site.startswith(OWN)}
            assert sum(own.values()) == (1 if stage == 3 else 0), where
