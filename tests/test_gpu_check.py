"""benchmarks/gpu_check.py, the issue-33 device check, run end to end on CPU (gloo, a tiny GPT): the shape of
its summary; and its overlap and model-state arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gpu_check_rank import overlap_fraction, paper_bytes  # noqa: E402


def test_overlap_fraction_is_the_share_of_communication_under_compute():
    assert overlap_fraction([(0, 10), (20, 30)], [(5, 25)]) == 0.5
    assert overlap_fraction([(0, 10), (5, 20)], [(0, 4), (2, 6), (30, 40)]) == 6 / 20  # unions, not sums
    assert overlap_fraction([(0, 10)], []) == 0.0 and overlap_fraction([], [(0, 5)]) is None


def test_paper_model_states():
    """ZeRO §5 (fp32 Adam 4 + 4 + 8 bytes) and §3.1 (mixed, 2 + 2 + 12), each term over N once partitioned."""
    assert [paper_bytes(100, s, "fp32", 4) for s in range(4)] == [1600, 1000, 700, 400]
    assert [paper_bytes(100, s, "bf16", 4) for s in range(4)] == [1600, 700, 550, 400]


@pytest.mark.slow
def test_runs_on_cpu_and_writes_its_summary(tmp_path):
    out = tmp_path / "gc"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks/gpu_check.py"), "--device", "cpu",
                           "--out", str(out), "--world-sizes", "2", "--runtimes", "stage3,ddp,stage2-qgz",
                           "--precisions", "fp32,bf16"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out.parent / "gc.json").read_text())
    assert summary["command"].startswith("python benchmarks/gpu_check.py --device cpu")
    [run] = summary["runs"]
    assert (run["world_size"], run["backend"], run["error"], run["fallback_reason"]) == (2, "gloo", None, None)
    cases = [(r["rank"], r["precision"], r["runtime"]) for r in run["rows"]]
    assert sorted(cases) == sorted((rank, p, r) for rank in (0, 1) for p, r in
                                   [("fp32", "stage3"), ("fp32", "ddp"), ("bf16", "stage3"), ("fp32", "stage2-qgz"),
                                    ("bf16", "stage2-qgz")])
    for r in run["rows"]:
        assert "error" not in r, r
        assert r["writes"].startswith("kept (stage 2 bf16"), r["writes"]  # Note [Writes between steps]
        assert r["samples_per_s"] > 0 and r["peak_bytes"] is None  # no CUDA: no device peak
        assert (r["syncs_per_micro_step"], r["syncs_per_optimizer_step"], r["sync_sites"]) == (0, 0, [])
        assert r["overlap"]["comm_spans"] > 0 and 0 <= r["overlap"]["fraction"] <= 1, r["overlap"]
        if r["runtime"].startswith("stage"):
            tol = 1e-5 if r["precision"] == "fp32" and "qgz" not in r["runtime"] else 1e-2
            assert max(r["parity"].values()) <= tol, r["parity"]
            assert r["paper_bytes"] == paper_bytes(r["psi"], int(r["runtime"][5]), r["precision"], 2)
            assert set(r["estimate"]) == {"model_states", "working_set", "activations", "device_total"}
            assert r["estimate"]["model_states"] >= r["paper_bytes"] * 0.9
    md = (out.parent / "gc.md").read_text()
    assert "### world size 2, gloo" in md and md.count("| fp32 | ") == 3 and md.count("| bf16 | ") == 2
    assert "Writes between steps (Note [Writes between steps]): kept" in md
