import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from distributed import RankPool  # noqa: E402
from slurm_cluster import missing_binaries, start_cluster  # noqa: E402
from sshd import LoopbackSshd  # noqa: E402

_pools: dict[int, RankPool] = {}

# Note [Test tiers]: ``python -m pytest -q -m "not slow"`` is the fast tier (every pure unit test and one small
# multi-rank parity case per ZeRO stage, marked ``smoke``; at most 2 minutes on an idle 2-core machine); the
# plain ``python -m pytest -q`` runs everything (CI, README). A test that starts processes belongs to the slow
# tier: a test file marks its end-to-end launches ``slow`` itself, and here every test that uses a fixture which
# starts processes is marked too, so that no such test can slip into the fast tier unmarked: the ``ranks`` pool
# (``slow``, unless marked ``smoke``), the loopback ``sshd`` (``ssh`` and ``slow``), the ``slurm_cluster``
# (``slurm`` and ``slow``), the ``tiny_reference`` job (``slow``); a test marked ``ssh`` or ``slurm`` is ``slow``
# as well.
_FIXTURE_MARKS = {"ranks": (), "sshd": ("ssh",), "slurm_cluster": ("slurm",), "tiny_reference": ()}


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker (-m)
def pytest_collection_modifyitems(items):
    """Mark the tests that start processes (Note [Test tiers])."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        for fixture, marks in _FIXTURE_MARKS.items():
            if fixture in fixtures:
                for mark in marks:
                    item.add_marker(mark)
        multi_rank = "ranks" in fixtures and item.get_closest_marker("smoke") is None
        remote = item.get_closest_marker("ssh") or item.get_closest_marker("slurm")
        if (multi_rank or remote or "tiny_reference" in fixtures) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_terminal_size_from_readline():
    """Note [COLUMNS in tests]: GNU readline, once imported (pytest imports it), writes ``COLUMNS`` and
    ``LINES`` of the terminal it found (80x24 without one) into the process's C environment, not into
    ``os.environ``; every child then inherits ``COLUMNS=80``, and zerorun's output into a pipe follows
    ``$COLUMNS`` (telemetry/layout.py ``output_width``), so summaries came out 80 columns wide under pytest
    only. A test that wants a width sets it (``monkeypatch.setenv``), which ``os.environ`` then holds."""
    for name in ("COLUMNS", "LINES"):
        if name not in os.environ:
            os.unsetenv(name)
    yield


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world_size)`` -> a live :class:`RankPool` of that size, shared by the whole session."""

    def get(world_size: int) -> RankPool:
        pool = _pools.get(world_size)
        if pool is None or not pool.alive:
            pool = _pools[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in _pools.values():
        pool.close(kill=not pool.alive)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A :class:`LoopbackSshd` on 127.0.0.2 and 127.0.0.3 for one test module (a module may change its keys)."""
    server = LoopbackSshd(str(tmp_path_factory.mktemp("sshd")), ["127.0.0.2", "127.0.0.3"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A two-node :class:`slurm_cluster.SlurmCluster` (2 CPUs per node) on loopback, shared by the session;
    skipped only when the SLURM/munge programs are missing (.ci/run installs them)."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"SLURM not installed (missing {', '.join(missing)}): apt-get install --no-install-recommends "
                    "slurmctld slurmd slurm-client munge")
    cluster = start_cluster(str(tmp_path_factory.mktemp("slurm")), nodes=2, cpus_per_node=2)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory) -> dict[int, float]:
    """Rank 0's loss of every step, by step, of the uninterrupted reference job (tests/tiny_reference.py: the
    tiny recipe, 2 local ranks, ``tiny_reference.RECIPE``), run once for the session's tests that compare with
    it (test_slurm_launch.py, test_ssh_launch.py): each of them had launched the same job itself."""
    import tiny_reference as reference

    return reference.run(str(tmp_path_factory.mktemp("tiny-reference")))


@pytest.fixture(scope="session", autouse=True)
def _job_records_in_tmp(tmp_path_factory):
    """Jobs inside a SLURM allocation record their run folder for ``zerorun attach`` under $XDG_STATE_HOME
    (zerorun/slurm/jobs.py): in the tests, a folder of the session, never the user's home."""
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if old is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = old
