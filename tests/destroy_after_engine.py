"""A one-rank script that imports zerorun first, as a user's script does, then builds a ZeRO engine over an Adam
optimizer (whose first construction imports ``torch._dynamo``), steps it, closes it and calls
``destroy_process_group()``; it prints the names of the threads left (Note [Last reference on the issuing thread]
in zerorun/zero/held.py). Usage: ``python tests/destroy_after_engine.py PORT STAGE``.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from zerorun.zero import ZeroConfig, initialize

port, stage = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
engine = initialize(nn.Linear(4, 1), optimizer="AdamW", optimizer_kwargs={"lr": 1e-3},
                    config=ZeroConfig(stage=stage))
engine.backward(engine(torch.randn(2, 4)).square().mean())
engine.step()
engine.close()
dist.destroy_process_group()
names = []
for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/comm") as f:
        names.append(f.read().strip())
print(",".join(sorted(names)))
