"""The commands that start no job: ``zerorun estimate``, ``bench`` (it starts its own), ``show``,
``consolidate``, ``import-deepspeed`` and ``env``."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from zerorun.cli.options import SSH_CONFIG, SSH_KEY, SSH_PORT, SSH_USER
from zerorun.errors import INT64_MAX, JobFailed, ZerorunError


def bench(
    recipe: str = typer.Argument(..., help="Recipe YAML file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="FIELD=VALUE overrides for every job."),
    hostfile: Optional[List[str]] = typer.Option(None, "-H", "--hostfile",
                                                 help="A hostfile to bench on; repeat for several."),
    stages: str = typer.Option("0,1,2,3", "--stages", help="ZeRO stages, comma-separated."),
    steps: int = typer.Option(30, "--steps", min=1, max=INT64_MAX, help="Measured optimizer steps per job."),
    warmup: int = typer.Option(5, "--warmup", min=0, max=INT64_MAX, help="Optimizer steps left out before measuring."),
    baseline: str = typer.Option("", "--baseline", help="Baselines to run too: ddp, fsdp2 (comma-separated)."),
    repeat: int = typer.Option(1, "--repeat", min=1, max=INT64_MAX,
                               help="Runs per combination; the median is reported."),
    nodes: Optional[str] = typer.Option(None, "--nodes", help="Inside a SLURM allocation, instead of -H: node "
                                        "counts, comma-separated (1,2: the allocation's first node, then its first "
                                        "two), each run through the slurm launcher."),
    zero_variants: str = typer.Option("", "--zero-variants", help="Stage 3 once per ZeRO++ variant, comma-"
                                      "separated: flat, hpz, qwz, hpz+qwz, qgz, hpz+qwz+qgz (docs/across-nodes.md)."),
    ssh_config: Optional[str] = SSH_CONFIG,
) -> None:
    """Run RECIPE on every hostfile at every stage (and the baselines) and compare them: bench.json, bench.csv,
    bench.png in <log.dir>/<name>/bench-<timestamp>/. Exit code 1 when any combination failed."""
    from zerorun import launch
    from zerorun.bench import parse_baselines, parse_nodes, parse_stages, parse_zero_variants, run_bench

    chosen = parse_stages(stages)
    failed, total, bench_dir = run_bench(recipe, overrides or [], hostfile or [], chosen,
                                         parse_baselines(baseline), steps, warmup, repeat, nodes=parse_nodes(nodes),
                                         variants=parse_zero_variants(zero_variants, chosen),
                                         ssh=launch.ssh_options(None, None, None, ssh_config))
    if failed:
        raise JobFailed(f"bench: {failed} of {total} combinations failed (reasons in {bench_dir}/bench.json)")


def estimate(
    recipe: Optional[str] = typer.Argument(None, help="Recipe YAML file (or give --params)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="FIELD=VALUE overrides, e.g. train.micro_batch_size=4."),
    hostfile: Optional[str] = typer.Option(None, "-H", "--hostfile", help="DeepSpeed-style hostfile."),
    params: Optional[str] = typer.Option(None, "--params", help="Parameter count without a recipe: 7B, 350M."),
    largest_layer: Optional[str] = typer.Option(None, "--largest-layer", help="With --params: parameters of the "
                                                "largest layer (stage 3 gathers it), e.g. 0.5B."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, max=INT64_MAX,
                                        help="Nodes (default: the hostfile's, else 1)."),
    procs_per_node: Optional[int] = typer.Option(None, "--procs-per-node", min=1, max=INT64_MAX,
                                                 help="Ranks per node (default: hostfile slots or "
                                                      "launch.procs_per_node)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp32, bf16 or fp16 (fp32 master); "
                                            "default: the recipe's, else fp32."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="adam (2 states), sgd (momentum: 1), none, "
                                            "or a torch.optim name; default: the recipe's, else adam."),
    device_memory: Optional[str] = typer.Option(None, "--gpu-memory", "--device-memory", help="Per rank: 80GiB, "
                                                "80GB (default: the -H hosts', else this machine's; on CPU host "
                                                "memory / ranks per node)."),
    cpu_memory: Optional[str] = typer.Option(None, "--host-memory", "--cpu-memory", help="Host memory per node "
                                             "(default: the smallest of the -H hosts', else this machine's)."),
    ssh_user: Optional[str] = SSH_USER, ssh_port: Optional[int] = SSH_PORT, ssh_key: Optional[str] = SSH_KEY,
    ssh_config: Optional[str] = SSH_CONFIG,
    bandwidth: str = typer.Option("100Gbps", "--bandwidth", help="Link speed per rank: 100Gbps, 12.5GB/s."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", min=1, max=INT64_MAX,
                                              help="Samples per micro-batch "
                                              "(default: train.micro_batch_size, else 1)."),
    offload: Optional[str] = typer.Option(None, "--offload", help="Optimizer offload rows besides none: none, "
                                          "cpu, disk or all (default: the recipe's zero.offload_optimizer if "
                                          "set, else all)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (bytes, seconds) instead of tables."),
) -> None:
    """Estimate memory per rank and communication per step for ZeRO stages 0-3 before launching."""
    from zerorun import estimate as est
    from zerorun.launch import ssh_options

    result = est.from_arguments(recipe=recipe, overrides=overrides or [], hostfile=hostfile, params=params,
                                largest_layer=largest_layer, nodes=nodes, procs_per_node=procs_per_node,
                                precision=precision, optimizer=optimizer, device_memory=device_memory,
                                cpu_memory=cpu_memory, bandwidth=bandwidth, micro_batch=micro_batch,
                                offload=offload, ssh=ssh_options(ssh_user, ssh_port, ssh_key, ssh_config))
    if as_json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        est.render(result)


def show(
    run_dir: str = typer.Argument(..., help="A run folder (runs/<name>/<timestamp>), or runs/<name> for its "
                                            "latest run."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Also draw loss and memory per rank over steps into "
                                                            "this image file (needs matplotlib)."),
) -> None:
    """Print the summary of a run again (from its metrics.jsonl) and how the job ended; --plot draws loss and
    memory."""
    from zerorun.slurm.attach import follow_submitted
    from zerorun.telemetry.show import show as run

    code = None if plot else follow_submitted(run_dir)  # a zerorun submit job still queued or running
    if code is None:
        run(run_dir, plot)
    elif code:
        raise typer.Exit(code)


def consolidate(
    ckpt_dir: str = typer.Argument(..., help="A checkpoint folder (step-N), or a folder of them (the latest)."),
    out: str = typer.Option(..., "--out", "-o", help="Output file: NAME.safetensors or NAME.pt; with --hf a folder."),
    hf: bool = typer.Option(False, "--hf", help="Write a Hugging Face folder (model.hf recipes): config.json, "
                            "safetensors shards, tokenizer files; AutoModelForCausalLM.from_pretrained loads it "
                            "(docs/hugging-face.md)."),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help="With --hf: largest weight file "
                                                 "(default 5GB)."),
) -> None:
    """Write the model of a sharded checkpoint as one fp32 state dict (no training processes needed)."""
    from zerorun.checkpoint import consolidate as run
    from zerorun.checkpoint import resolve
    from zerorun.telemetry.console import human_bytes

    if max_shard_size is not None and not hf:  # it was ignored without a word (a review)
        raise ZerorunError(f"--max-shard-size {max_shard_size}: only with --hf (a .safetensors or .pt file is written "
                           "whole)")
    source = resolve(ckpt_dir)  # a folder of checkpoints: its latest, named in the line below
    if hf:
        from zerorun.hf.export import export_hf

        count, nbytes = export_hf(source, out, max_shard_size=max_shard_size or "5GB")
        print(f"zerorun: wrote {count} weight file{'s' * (count != 1)} ({human_bytes(nbytes)}) of {source} to {out}")
        return
    count, nbytes = run(source, out)
    print(f"zerorun: wrote {count} tensors ({human_bytes(nbytes)}) of {source} to {out}")


def import_deepspeed(
    ds_config: str = typer.Argument(..., help="A DeepSpeed config (JSON)."),
    hostfile: Optional[str] = typer.Option(None, "--hostfile", "-H", help="DeepSpeed hostfile: its slots split "
                                           "train_batch_size and set launch.procs_per_node."),
    lr: Optional[float] = typer.Option(None, "--lr", help="The learning rate, for the config's \"auto\" "
                                       "(the HF Trainer's learning_rate)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, max=INT64_MAX,
                                        help="Optimizer steps, for \"auto\" (max_steps)."),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size", min=1, max=INT64_MAX,
                                                   help="Samples per rank per "
                                                   "micro-step, for \"auto\" (per_device_train_batch_size)."),
) -> None:
    """Print a recipe made from a DeepSpeed config (ZeRO stage, offload, precision and loss scaling, clipping,
    batch sizes, optimizer, scheduler, bucket sizes, monitors); HF Trainer "auto" values from --lr, --steps,
    --micro-batch-size or its defaults; what to fill in and the fields it drops are listed in it and on stderr."""
    from zerorun.hf.deepspeed import import_deepspeed as run

    text, dropped, fill_in = run(ds_config, hostfile, lr=lr, steps=steps, micro_batch_size=micro_batch_size)
    sys.stdout.write(text)
    for line in fill_in:
        sys.stderr.write(f"zerorun: fill in {line}\n")
    for line in dropped:
        sys.stderr.write(f"zerorun: dropped {line}\n")


def env_report(
    hostfile: Optional[str] = typer.Option(None, "-H", "--hostfile", help="Also check that these hosts are "
                                           "reachable (local ones without SSH, the others over SSH)."),
    ssh_user: Optional[str] = SSH_USER, ssh_port: Optional[int] = SSH_PORT, ssh_key: Optional[str] = SSH_KEY,
    ssh_config: Optional[str] = SSH_CONFIG,
) -> None:
    """Print what a bug report needs: zerorun, python and torch versions, backends, CPU and GPUs, the
    launcher's libraries (fabric, paramiko, ...), and with -H whether each host is reachable."""
    from zerorun.cli.env import aligned, report_lines, unreachable
    from zerorun.errors import JobFailed
    from zerorun.launch import ssh_options

    ssh = ssh_options(ssh_user, ssh_port, ssh_key, ssh_config)
    lines = report_lines(hostfile, ssh)
    sys.stdout.write(aligned(lines))
    down = unreachable(lines)
    if down:  # `zerorun env -H hosts && zerorun train ...` stops here (found by review: exit 0)
        raise JobFailed(f"{len(down)} of the hostfile's hosts did not answer: {', '.join(down)} (rows above)")
