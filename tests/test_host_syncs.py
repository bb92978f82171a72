"""Host syncs in steady micro-steps and in stage 3's step extras (issue 33 item 3; tests/host_syncs.py counts
zerorun's own ``.item()/bool()/int()/float()/tolist()`` reads, the CPU stand-in for a GPU stall).

Bounds held here, per steady step of 2 micro-steps (the optimizer's own step at stages 0-2 is
tests/test_step_syncs.py's): no read of a device value in forward, backward or stage 3's step extras, at
every stage. The ranks' agreements are host values summed on the host over a gloo group (Note [Agreements on
the host] in zerorun/zero/comm.py; ``Comm.agree``, its one read is of a CPU tensor made there and never on the
device, checked below with an NCCL group stood in): 1 in the step's last backward (unused parameters and late
gradients, Note [Per-parameter readiness] in reducer.py); stage 3: 1 per backward more (Note [Backward on some
ranks] in stage3_checks.py) and 1 in the step (Note [Same units on every rank]). Before, each was a device
tensor copied in and read back: 1 host sync per step at stages 0-2, 3 at stage 3.
"""

import pytest

import host_sync_cases as cases

COMBOS = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]
def _agree_site() -> str:
    """``file:line`` of ``Comm.agree``'s one read: a CPU tensor summed over the gloo control group."""
    import inspect

    from zerorun.zero import comm

    lines, first = inspect.getsourcelines(comm.Comm.agree)
    return f"zerorun/zero/comm.py:{first + next(i for i, line in enumerate(lines) if '.tolist()' in line)}"


AGREE = _agree_site()
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
            # the last backward's agreement carries stage 3's gather digest (Note [Same units on every rank]):
            # the steady step agrees on nothing more
            for phase, agreements in (("backward0", checks), ("backward1", checks + 1), ("step", 0)):
                sites = {site: n for site, n in phases[phase].items() if site.startswith(OWN)}
                assert sites == ({AGREE: agreements} if agreements else {}), (phase, where)


def test_a_groups_timeout_is_read_from_torch(ranks):
    """The control group beside an NCCL group takes that group's timeout (below): torch's private options, read
    in zero/torch_internals.py, still give a gloo group's own (7 s) and the world's (torch's default here)."""
    for got in ranks(2).run(cases.group_timeouts):
        assert got[0] == 7.0 and got[1] > 7.0, got


def test_agreements_are_cpu_tensors_on_a_gloo_group_beside_nccl(monkeypatch):
    """Note [Agreements on the host]: under an NCCL group (or any device backend without CPU tensors), Comm.agree
    sums a CPU tensor over a gloo group of the same ranks made beside it (by those ranks only, once per group);
    under gloo, MPI, or a group with a gloo backend for CPU tensors, over the group itself. The read of ``AGREE``
    above is that CPU tensor's."""
    import datetime

    import torch
    import torch.distributed as dist

    from zerorun.zero import comm
    from zerorun.zero.comm import _Done
    from zerorun.zero.held import HeldWorks

    made, reduced = [], []
    monkeypatch.setattr(comm, "_CONTROL_GROUPS", {})
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or f"gloo-{len(made)}")
    waits = {"main": datetime.timedelta(seconds=600), "other": None}  # launch.collective_timeout_s; unknown
    monkeypatch.setattr(comm, "group_timeout", waits.get)
    for backend, group, want in (("nccl", "main", "gloo-1"), ("nccl", "main", "gloo-1"), ("xccl", "other", "gloo-2"),
                                 ("gloo", "main", "main"), ("cuda:nccl,cpu:gloo", "main", "main"),
                                 ("mpi", "main", "main")):
        monkeypatch.setattr(dist, "get_backend", lambda group, b=backend: b)
        assert comm.control_group(group) == want, backend
    # one gloo group per device group, shared by the engines built over it (a sweep leaves no groups behind), whose
    # collectives wait as long as the device group's (before: torch's default, 30 minutes)
    assert made == [([0, 1], {"backend": "gloo", "use_local_synchronization": True, "timeout": waits[g]})
                    for g in ("main", "other")]
    agreeing = comm.Comm.__new__(comm.Comm)
    agreeing.world_size, agreeing.control, agreeing.held = 2, "gloo-1", HeldWorks(4)

    def all_reduce(t, group, async_op=False):
        reduced.append((t.device.type, t.dtype, group))
        t.mul_(2)
        return _Done()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert agreeing.agree([1, 0, 3]) == [2, 0, 6]
    assert agreeing.agree([0.5], dtype=torch.float64) == [1.0]
    assert reduced == [("cpu", torch.int64, "gloo-1"), ("cpu", torch.float64, "gloo-1")]
