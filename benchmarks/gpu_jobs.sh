#!/usr/bin/env bash
# The launcher's CUDA path on a GPU machine (issue 33), beside benchmarks/gpu_check.py (the runtime alone):
# the GPUs the launcher counts (NVML, torch-free) against torch's, `zerorun env`, then `zerorun train` jobs of
# recipes/tiny.yaml with launch.procs_per_node=auto (one rank per visible GPU: NCCL, the worker's pinned loss
# copy, stage 3 and the offloaded step's staging on CUDA), each job's summary printed.
#   bash benchmarks/gpu_jobs.sh [RUN_DIR]          (about a minute on one H200; on CPU it runs the same jobs)
set -u
cd "$(dirname "$0")/.."
runs=${1:-/tmp/zerorun-gpu-jobs}
python3 -c "import torch; from zerorun.launch.slots import visible_gpus
print('GPUs the launcher counts:', visible_gpus(), '| torch.cuda.device_count():', torch.cuda.device_count())"
python3 -m zerorun env 2>&1 | tail -15
status=0
for args in "zero.stage=0" "zero.stage=2 precision=bf16" "zero.stage=3 zero.units=[Block]" \
            "zero.stage=2 zero.offload_optimizer=cpu"; do
    echo "== zerorun train recipes/tiny.yaml $args"
    # shellcheck disable=SC2086  # each line is several overrides
    python3 -m zerorun train recipes/tiny.yaml --no-dashboard launch.procs_per_node=auto train.steps=20 \
        train.eval_every=10 log.every=5 "log.dir=$runs" $args > "$runs.log" 2>&1 || status=1
    grep -E "ranks? on|device|loss|step time|done|error|Error" "$runs.log" | tail -12
done
exit $status
