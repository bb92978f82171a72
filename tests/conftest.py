import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from distributed import RankPool  # noqa: E402

_pools: dict[int, RankPool] = {}


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
