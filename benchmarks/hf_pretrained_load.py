"""Peak RSS per rank when stage 3 loads a ~200M-parameter Hugging Face Llama from a pretrained folder on 2 ranks,
against one full fp32 copy of the model (4Ψ bytes) and against ``from_pretrained`` in one process (what every
rank of stages 0-2 does).

    python benchmarks/hf_pretrained_load.py                    # ~200M Llama (tied), 2 ranks, gloo on CPU
    python benchmarks/hf_pretrained_load.py --quick            # a ~20M one, for a smoke check

The model folder is made once in --dir (HF's own init, ``save_pretrained``: one safetensors file). Each mode runs
in fresh processes (torchrun) with ``MALLOC_MMAP_THRESHOLD_`` as zerorun's launcher sets it, so each rank's peak RSS (``ru_maxrss``, resident file-backed pages of the mapped
safetensors file included) is its own. Reported per rank: RSS after imports (the baseline), peak RSS, the peak
above the baseline, RSS after each phase (built on meta: the model classes imported; engine: stage 3's
partition, whose replay of the construction holds one whole parameter at a time; loaded), the rank's model-state bytes at stage 3 (params + grads slices; no optimizer state before the
first step) and the bytes it read from the files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "BENCH "
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def config(quick: bool) -> dict:
    if quick:
        return dict(model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True)
    # embeddings 32000 x 1024 (tied) + 10 x (4 x 1024² attention + 3 x 1024 x 4096 MLP) ≈ 201M parameters
    return dict(model_type="llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=10,
                num_attention_heads=16, num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=True)


def make_folder(folder: str, quick: bool) -> None:
    if os.path.isfile(os.path.join(folder, "config.json")):
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = config(quick)
    cfg = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)


def worker(mode: str, folder: str) -> None:
    import resource

    import psutil
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from zerorun import zero
    from zerorun.hf.model import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import transformers  # noqa: F401 - in the baseline, as in a rank

    base = psutil.Process().memory_info().rss
    read = 0
    phases: dict[str, list[int]] = {}  # phase -> [rss, peak rss] after it
    if mode == "stage3":
        from zerorun.hf.load import load_pretrained_slices

        def mark(what: str) -> None:
            phases[what] = [psutil.Process().memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]

        model = zero.deferred_init(build_model, pretrained=folder)
        mark("built on meta")
        engine = zero.initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-4},
                                 config=zero.ZeroConfig(stage=3, units=("LlamaDecoderLayer",)))
        mark("engine")
        read = load_pretrained_slices(model, engine)
        mark("loaded")
        state = engine.memory_bytes()
        states = state["params"] + state["grads"] + state["optimizer"]
    else:
        model = build_model(pretrained=folder)
        # from_pretrained maps the file: its pages become resident when first used (the first forward), so
        # read every parameter once to count the full copy a stage 0-2 rank holds while training
        with torch.no_grad():
            for p in model.parameters():
                p.sum()
        states = 4 * sum(p.numel() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    line = PREFIX + json.dumps(dict(mode=mode, rank=dist.get_rank(), params=params, base_rss=base, peak_rss=peak,
                                    peak_above_base=peak - base, model_state_bytes=states, read_bytes=read,
                                    phases=phases)) + "\n"
    os.write(1, line.encode())  # one write: the ranks share the pipe
    dist.barrier()
    dist.destroy_process_group()


def run(mode: str, folder: str, nproc: int) -> list[dict]:
    from zerorun.allocator import MMAP_THRESHOLD

    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))  # as zerorun's ranks
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           "--master-port=0" if False else "--master-port=29613", os.path.abspath(__file__), "--worker", mode,
           "--dir", folder]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    rows = [json.loads(line[len(PREFIX):]) for line in out.stdout.splitlines() if line.startswith(PREFIX)]
    if out.returncode or not rows:
        raise SystemExit(f"{mode} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dir", default=None, help="model folder (made when missing)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    folder = args.dir or os.path.join(ROOT, "runs", "bench-hf-llama-" + ("20m" if args.quick else "200m"))
    if args.worker:
        return worker(args.worker, folder)
    make_folder(folder, args.quick)
    rows = run("stage3", folder, 2) + run("from_pretrained", folder, 1)
    mib = 2**20
    full = 4 * rows[0]["params"]
    print(f"model: {rows[0]['params'] / 1e6:.1f}M parameters, one full fp32 copy = {full / mib:.0f} MiB")
    print(f"{'mode':16} {'rank':>4} {'base RSS':>10} {'peak RSS':>10} {'peak-base':>10} {'states':>10} {'read':>10}")
    for r in rows:
        print(f"{r['mode']:16} {r['rank']:>4} {r['base_rss'] / mib:>7.0f}MiB {r['peak_rss'] / mib:>7.0f}MiB "
              f"{r['peak_above_base'] / mib:>7.0f}MiB {r['model_state_bytes'] / mib:>7.0f}MiB "
              f"{r['read_bytes'] / mib:>7.0f}MiB")
    for r in rows:
        if r["phases"]:
            print(f"{r['mode']} rank {r['rank']}: " + ", ".join(
                f"{k}: RSS {v[0] / mib:.0f} MiB (peak {v[1] / mib:.0f})" for k, v in r["phases"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"full_fp32_bytes": full, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
