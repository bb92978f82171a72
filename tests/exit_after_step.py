"""One rank of a two-rank script that builds a ZeRO engine, steps it three times and ends there, without
``destroy_process_group``, its engine alive into the interpreter's shutdown (Note [Last reference on the issuing
thread] in zerorun/zero/held.py). Usage: ``python tests/exit_after_step.py RANK PORT STAGE``.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

rank, port, stage = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

from zerorun.zero import ZeroConfig, initialize  # noqa: E402  (as a user's script may import it)

torch.manual_seed(0)
engine = initialize(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), optimizer="SGD",
                    optimizer_kwargs={"lr": 0.1}, config=ZeroConfig(stage=stage))
for _ in range(3):
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
