"""``zerorun launch script.py`` on local ranks: the user's script, its arguments, its errors."""

import re
import subprocess
import sys

import pytest

from test_train_e2e import job_id, read_events, survivors

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys, time
import zerorun
rank = int(os.environ["RANK"])
print("args", sys.argv[1:])
zerorun.report(1, 1.5, steps=2)
if rank == 1:
    while not os.path.exists("rank0-printed"):  # rank 0's lines are out before the teardown stops it
        time.sleep(0.05)
    raise ValueError("bad shard " + sys.argv[2])
import faulthandler  # what scripts do with the streams under torchrun (Note [Rank streams])
faulthandler.enable()
sys.stdout.reconfigure(line_buffering=True)
sys.stdout.buffer.write(b"raw bytes\\n")
sys.stdout.buffer.flush()
sys.stdout.writelines(["w1\\n", "w2\\n"])
print("to stderr", sys.stdout.encoding, sys.stderr.errors, sys.stdout.isatty(), sys.stdout.fileno(), file=sys.stderr)
open("rank0-printed", "w").close()
"""


def test_script_runs_on_every_rank_and_its_exception_is_named(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "zerorun", "launch", "--num-procs", "2", "--log-dir",
                          str(tmp_path / "runs"), "s.py", "--shard", "7"], cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 ranks on localhostx2, user script" in out.stdout
    assert "[rank 0] args ['--shard', '7']" in out.stdout  # options after the script are the script's
    for line in ("raw bytes", "w1", "w2", "to stderr utf-8 backslashreplace False 1"):  # as under torchrun
        assert f"[rank 0] {line}\n" in out.stdout, out.stdout
    assert out.stderr.startswith(f"zerorun: error: rank 1 on localhost: ValueError: bad shard 7 (at "
                                 f"{tmp_path / 's.py'}:10 in <module>)"), out.stderr
    events = read_events(tmp_path / "runs")
    assert {e["rank"] for e in events if e["event"] == "step"} == {0, 1}
    starts = [e for e in events if e["event"] == "start"]  # a script's ranks start like the built-in worker's
    assert sorted(e["rank"] for e in starts) == [0, 1] and all(e["world_size"] == 2 for e in starts), starts
    from zerorun.allocator import find_tcmalloc  # Note [Rank allocator]: a script's ranks get it too

    assert {e["allocator"] for e in starts} == {"tcmalloc" if find_tcmalloc() else "mimalloc"}, starts
    assert "2 ranks started (torch " in out.stdout
    assert survivors(job_id(out.stdout)) == []


EXIT_0 = """
import datetime, os, time
import torch, torch.distributed as dist
import zerorun
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
for step in range(1, 1000):
    if step == 3 and dist.get_rank() == 1:
        os._exit(0)  # no finish event, no exception: only its exit code tells
    dist.all_reduce(torch.ones(1))
    zerorun.report(step, 1.0, steps=1000)
    time.sleep(0.05)
"""


def test_a_rank_that_exits_0_in_the_middle_of_the_job_is_named(tmp_path):
    """Issue 34 item 9 (Note [Rank exits] in launch/torchrun.py): not "rank 1 stopped responding"."""
    (tmp_path / "s.py").write_text(EXIT_0)
    out = subprocess.run([sys.executable, "-m", "zerorun", "launch", "--num-procs", "2", "--log-dir",
                          str(tmp_path / "runs"), "s.py"], cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.startswith("zerorun: error: rank 1 on localhost: rank 1 exited (exit code 0) in the middle "
                                 "of the job; rank 0 then failed: "), out.stderr
    assert re.search(r"^(localhost)?\s+1\s+exit 0\s", out.stdout, re.M), out.stdout  # the summary's status
    assert survivors(job_id(out.stdout)) == []
