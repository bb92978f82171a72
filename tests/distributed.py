"""A pool of real gloo ranks kept alive across tests, so torch is imported once per world size.

``RankPool(world_size).run(fn, **kwargs)`` calls ``fn(**kwargs)`` on every rank (``fn`` must be importable:
a module-level function) and returns the per-rank results, in rank order. An exception on any rank is raised
in the test with that rank's traceback; a case that does not finish within ``timeout`` seconds kills the pool.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world_size: int, port: int, inbox, outbox) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    while True:
        job = inbox.get()
        if job is None:
            break
        module, name, kwargs = job
        try:
            fn = getattr(importlib.import_module(module), name)
            outbox.put((rank, True, fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned processes in one gloo group on 127.0.0.1."""

    def __init__(self, world_size: int, timeout: float = 300.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, port, self.inboxes[r], self.outbox), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, **kwargs) -> list:
        """Run ``fn(**kwargs)`` on every rank; return ``[result of rank 0, rank 1, ...]``."""
        for q in self.inboxes:
            q.put((fn.__module__, fn.__name__, kwargs))
        results: dict[int, object] = {}
        errors = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.outbox.get(timeout=self.timeout)
            except Exception:
                self.close(kill=True)
                raise TimeoutError(f"{fn.__name__} did not finish on all {self.world_size} ranks in {self.timeout} s")
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            self.close(kill=True)
            raise AssertionError("\n".join(errors))
        return [results[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.inboxes:
                q.put(None)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
