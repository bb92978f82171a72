"""Failure attribution from what the nodes print (Note [Blame] in launch/blame.py), without processes."""

import queue
import signal

from zerorun.recipe.hostfile import Host
from zerorun.launch.nodes import Ended, Line
from zerorun.launch.plan import build_plan
from zerorun.launch.supervisor import Supervisor
from zerorun.telemetry.events import format_event

SUMMARY = """\
Failures:
[1]:
  time      : 2026-11-30_05:00:01
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 101)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_05:00:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 102)
"""
#: the same failures as zerorun's torchrun sends them (Note [Failure report] in launch/torchrun.py): what blame reads
REPORT = ('@zerorun-node {"failures": [{"rank": 0, "exit_code": -15}, {"rank": 1, "exit_code": -6}], '
          '"root_cause": 1}')


def supervised(lines: list[str]) -> tuple[Supervisor, object]:
    """A supervisor of one 2-rank node that printed ``lines`` and ended with exit code 1, and its failure."""
    plan = build_plan([Host("localhost", 2)], "{}", "job", 12345)
    q: queue.Queue = queue.Queue()
    sup = Supervisor(plan, [], q, lambda e: None, lambda n, l: None)
    for line in lines:
        q.put(Line(0, line))
    q.put(Ended(0, 1))
    while not q.empty():
        sup._drain(0.01)
    return sup, sup._failure(0)


def supervise(lines: list[str]):
    return supervised(lines)[1]


def test_torchrun_root_cause_is_blamed_not_the_rank_it_terminated():
    sup, result = supervised([REPORT] + SUMMARY.splitlines())
    assert (result.rank, result.exit_code) == (1, 1)
    assert result.message == "rank process ended (killed by SIGABRT)"
    # the rank torchrun stopped after it shows "stopped", as zerorun's own teardown's; it showed "killed" (a review)
    assert sup.rank_exits == {1: -6}


def test_a_rank_killed_by_its_own_abort_is_named_with_its_last_words():
    """A rank that gloo aborted (a collective mismatch: "Received data size doesn't match expected size") said
    only "rank process ended (killed by SIGABRT)"; the reason was in output.log alone. Its ``what():`` line (the
    file:line in brackets left out) or CPython's fatal error now ends the message."""
    what = ("[rank 1]   what():  [enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length "
            "<= op.nbytes. Received data size doesn't match expected size. Is there a distributed collective mismatch?")
    result = supervise(["[rank 1] terminate called after throwing an instance of 'gloo::EnforceNotMet'", what, REPORT]
                       + SUMMARY.splitlines())
    assert (result.rank, result.message) == (1, "rank process ended (killed by SIGABRT): op.preamble.length <= "
                                                "op.nbytes. Received data size doesn't match expected size. Is there "
                                                "a distributed collective mismatch?")
    result = supervise(["[rank 1]: Fatal Python error: Segmentation fault", REPORT] + SUMMARY.splitlines())
    assert result.message == "rank process ended (killed by SIGABRT): Fatal Python error: Segmentation fault"
    result = supervise(["[rank 0]   what():  something else", REPORT] + SUMMARY.splitlines())
    assert result.message == "rank process ended (killed by SIGABRT)"  # another rank's words are not rank 1's
    # gloo's C++ abort writes to the rank's standard error directly, with no rank in front (a review: the message
    # ended at "killed by SIGABRT"); the one rank of the node killed by SIGABRT said it
    result = supervise(["terminate called after throwing an instance of 'gloo::EnforceNotMet'", what.split("] ", 1)[1],
                        REPORT] + SUMMARY.splitlines())
    assert result.message.startswith("rank process ended (killed by SIGABRT): op.preamble.length <= op.nbytes."), \
        result.message


def test_own_error_beats_peer_failure_and_silent_ranks():
    peer = format_event("error", 0, type="RuntimeError", message="Connection reset by peer", peer_failure=True)
    own = format_event("error", 1, type="ValueError", message="bad batch", peer_failure=False, where="m.py:3 in f")
    result = supervise([peer, own, REPORT] + SUMMARY.splitlines())
    assert result.rank == 1 and result.message == "ValueError: bad batch (at m.py:3 in f)"


def test_only_peer_failures_blame_the_rank_that_went_quiet():
    """Issue 17 item 8: rank 0 timed out waiting for rank 1, which said nothing since (hung, or exited): rank 1
    is named, not rank 0; when every rank reports a peer failure, the earliest is named."""
    step = format_event("step", 1, step=3)
    peer = format_event("error", 0, type="RuntimeError", message="Connection closed by peer", peer_failure=True)
    result = supervise([step, peer])
    assert result.rank == 1 and result.message.startswith("rank 1 stopped responding (last heard ")
    assert result.message.endswith("rank 0 then failed: RuntimeError: Connection closed by peer")
    both = format_event("error", 1, type="RuntimeError", message="timed out", peer_failure=True)
    result = supervise([peer, both])
    assert result.rank == 0 and "Connection closed by peer" in result.message
    finished = format_event("finish", 1)
    result = supervise([finished, peer])
    assert result.rank == 1 and result.message.startswith("rank 1 finished while its peers still needed it")


def test_a_rank_that_exits_with_its_own_code_is_named_with_its_last_line():
    """``raise SystemExit("fatal: ...")`` in a script: the job said only "rank process ended (exit code 1)"."""
    report = '@zerorun-node {"failures": [{"rank": 1, "exit_code": 1}, {"rank": 0, "exit_code": -15}], "root_cause": 1}'
    result = supervise(["[rank 1] loading", "[rank 1] fatal: bad config on rank 1", "[rank 0] waiting", report])
    assert (result.rank, result.message) == (1, "rank process ended (exit code 1): fatal: bad config on rank 1")


def test_a_rank_hung_beside_the_one_that_timed_out_is_named_not_its_teardown():
    """One node: rank 1 hangs, rank 0 times out (a peer failure) and exits 1, and torchrun then stops rank 1 with
    SIGTERM. The job said "rank 1: rank process ended (killed by SIGTERM)", the teardown, and left out rank 0's
    timeout (a review); a rank that torchrun's report names as the first failure keeps its own exit."""
    step = format_event("step", 1, step=3)
    peer = format_event("error", 0, type="RuntimeError", message="Timed out waiting 10000ms", peer_failure=True)
    report = '@zerorun-node {"failures": [{"rank": 0, "exit_code": 1}, {"rank": 1, "exit_code": -15}], "root_cause": 0}'
    result = supervise([step, peer, report])
    assert result.rank == 1 and result.message.startswith("rank 1 stopped responding (last heard "), result.message
    assert result.message.endswith("rank 0 then failed: RuntimeError: Timed out waiting 10000ms")
    killed = '@zerorun-node {"failures": [{"rank": 1, "exit_code": -9}, {"rank": 0, "exit_code": 1}], "root_cause": 1}'
    result = supervise([step, peer, killed])  # the OOM killer: rank 1 died first
    assert (result.rank, result.message) == (1, "rank process ended (killed by SIGKILL)")
    # rank 1 killed by SIGKILL, its peer's "connection closed" reported first: a death, not a hang (a review)
    reset = format_event("error", 0, type="RuntimeError", message="Connection closed by peer", peer_failure=True)
    report = '@zerorun-node {"failures": [{"rank": 0, "exit_code": 1}, {"rank": 1, "exit_code": -9}], "root_cause": 0}'
    result = supervise([step, reset, report])
    assert (result.rank, result.message) == (1, "rank process ended (killed by SIGKILL)")


def test_node_that_ends_without_rank_output_is_named_with_its_last_line():
    plan = build_plan([Host("localhost", 1), Host("127.0.0.2", 1)], "{}", "job", 12345)
    q: queue.Queue = queue.Queue()
    sup = Supervisor(plan, [], q, lambda e: None, lambda n, l: None)
    q.put(Line(1, "sh: 2: cd: can't cd to /nowhere"))
    q.put(Ended(1, 2))
    while not q.empty():
        sup._drain(0.01)
    result = sup._failure(1)
    assert (result.rank, result.host) == (None, "127.0.0.2")
    assert result.message == "node 1 ended (exit code 2): sh: 2: cd: can't cd to /nowhere"
    assert not result.lost  # the node's own command failed: not a lost host


def test_lost_connection_is_blamed_over_the_peer_failures_it_causes():
    plan = build_plan([Host("localhost", 1), Host("127.0.0.2", 1)], "{}", "job", 12345)
    q: queue.Queue = queue.Queue()
    sup = Supervisor(plan, [object(), object()], q, lambda e: None, lambda n, l: None)
    q.put(Line(0, format_event("error", 0, type="RuntimeError", message="Connection reset by peer", peer_failure=True)))
    q.put(Ended(1, 255, "lost the SSH connection to 127.0.0.2"))
    while not q.empty():
        sup._drain(0.01)
    result = sup._failure(1)
    assert (result.rank, result.host) == (None, "127.0.0.2")
    assert result.message == "node 1 ended (lost the SSH connection to 127.0.0.2)"
    assert result.lost  # a restart with launch.min_nodes leaves the host out (Note [Lost nodes])


def test_peer_failures_on_one_node_wait_for_the_node_whose_rank_died():
    """Two nodes: node 0 ends first, having seen only rank 0's peer failure; node 1's summary (rank 1 killed)
    arrives a moment later. Rank 1 is blamed, not rank 0."""
    import threading

    plan = build_plan([Host("localhost", 1), Host("127.0.0.2", 1)], "{}", "job", 12345)
    q: queue.Queue = queue.Queue()
    sup = Supervisor(plan, [object(), object()], q, lambda e: None, lambda n, l: None)
    q.put(Line(0, format_event("error", 0, type="RuntimeError", message="Connection reset by peer", peer_failure=True)))
    q.put(Ended(0, 1))

    def later():
        for line in ['@zerorun-node {"failures": [{"rank": 1, "exit_code": -9}], "root_cause": 1}',
                     "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 0)",
                     "  exitcode  : -9 (pid: 7)"]:
            q.put(Line(1, line))
        q.put(Ended(1, 1))

    threading.Timer(0.5, later).start()
    result = sup._failure(None)
    assert (result.rank, result.host) == (1, "127.0.0.2")
    assert result.message == "rank process ended (killed by SIGKILL)" and not result.lost


class FakeNode:
    """A node that reports ``left`` surviving processes for its first kill calls, then none."""

    def __init__(self, spec, left: int, unverified: str | None = None):
        self.spec, self.left, self.unverified, self.signals = spec, left, unverified, []

    def send_signal(self, sig):
        self.signals.append(sig)

    def kill_survivors(self, sig):
        left, self.left = self.left, 0
        return left


def test_teardown_repeats_until_every_host_reports_none_left_and_names_unverified_hosts():
    plan = build_plan([Host("localhost", 1), Host("127.0.0.2", 1)], "{}", "job", 12345)
    q: queue.Queue = queue.Queue()
    nodes = [FakeNode(plan.nodes[0], 2), FakeNode(plan.nodes[1], 1, unverified="TimeoutError: timed out")]
    sup = Supervisor(plan, nodes, q, lambda e: None, lambda n, l: None, grace_s=0.1)
    for i in range(2):
        q.put(Ended(i, 0))
    while not q.empty():
        sup._drain(0.01)
    sup._teardown()
    # no SIGTERM to nodes that had ended; SIGKILL rounds until a round finds nothing left on any host
    assert [n.signals for n in nodes] == [[signal.SIGKILL] * 2] * 2
    assert sup.unverified == {"127.0.0.2": "TimeoutError: timed out"}


def test_every_rank_stopped_on_sigterm_is_an_interruption_naming_the_checkpoint():
    """Note [Checkpoint on SIGTERM]: ranks that saved and exited 143 are not a failure to blame on a rank."""
    plan = build_plan([Host("localhost", 2)], "{}", "job", 12345)
    q: queue.Queue = queue.Queue()
    sup = Supervisor(plan, [object()], q, lambda e: None, lambda n, l: None)
    for rank in (0, 1):
        q.put(Line(0, format_event("stopped", rank, step=7, steps=80, signal="SIGTERM", path="/ck/step-00000007")))
    q.put(Ended(0, 143))
    result = sup._watch()
    assert (result.status, result.exit_code, result.rank) == ("interrupted", 143, None)
    assert result.message == ("stopped by SIGTERM after step 7: every rank saved checkpoint /ck/step-00000007 and "
                              "exited; continue with zerorun train ... --resume")


#: what a node's torchrun prints on SIGTERM (from a real run's output.log, the traceback shortened)
TORCHRUN_STOP = [
    "W1201 22:21:13.270000 28791 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, "
    "shutting down workers",
    "W1201 22:21:13.270000 28791 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 28795 "
    "closing signal SIGTERM",
    "Traceback (most recent call last):",
    '  File "torch/distributed/run.py", line 1028, in main',
    "    run(args)",
    "torch.distributed.elastic.multiprocessing.api.SignalException: Process 28791 got signal: 15",
]


class TorchrunNode(FakeNode):
    """A node that prints :data:`TORCHRUN_STOP` and ends (exit status 1) on SIGTERM, as torchrun does."""

    def __init__(self, spec, lines: queue.Queue):
        super().__init__(spec, 0)
        self.lines = lines

    def start(self):
        pass

    def send_signal(self, sig):
        super().send_signal(sig)
        if sig == signal.SIGTERM:
            for line in TORCHRUN_STOP:
                self.lines.put(Line(self.spec.node_rank, line))
            self.lines.put(Ended(self.spec.node_rank, 1))


def stopped_job(stop: str | None):
    """Run a one-node job under the supervisor with a plain view: the model check finds a problem at once, or
    (``stop``) the supervisor receives that signal first. Returns the result and what the view printed."""
    import io

    from zerorun.telemetry.console import PlainView
    from zerorun.telemetry.state import JobState

    plan = build_plan([Host("localhost", 2)], "{}", "job", 12345)
    q: queue.Queue = queue.Queue()
    state, out = JobState(world_size=2), io.StringIO()
    view = PlainView(out, state)
    sup = Supervisor(plan, [TorchrunNode(plan.nodes[0], q)], q, view.event, view.line, grace_s=2.0,
                     check=lambda: None if stop else "recipe: zero.units: no module of class Nope in the model",
                     on_stopping=state.stopping)
    if stop:
        sup._stop = stop
    return sup.run(), out.getvalue().splitlines()


def test_a_job_the_launcher_stops_itself_is_not_shown_as_interrupted():
    """The model check's problem (or a failed rank) makes the launcher SIGTERM the nodes still running: their
    torchrun's stop lines are not shown as "job interrupted: torchrun got SIGTERM", which read as a signal from
    outside beside the launcher's one-line error; a Ctrl-C or SIGTERM to the launcher still says so in one line
    (Note [Interrupted job] in telemetry/logtail.py)."""
    result, shown = stopped_job(None)
    assert (result.status, result.exit_code) == ("failed", 2)
    assert shown == [], shown
    for sig in ("SIGINT", "SIGTERM"):
        result, shown = stopped_job(sig)
        assert result.status == "interrupted"
        assert shown == ["[node 0] job interrupted: torchrun got SIGTERM and stops every rank (full output: the run "
                         "folder's output.log)"], shown


def rank_exit(rank: int, code: int) -> str:
    """The line zerorun's torchrun prints when a rank ends on its own (Note [Rank exits] in launch/torchrun.py)."""
    return f'@zerorun-node {{"rank": {rank}, "exit_code": {code}}}'


def test_a_rank_that_exits_0_in_the_middle_of_the_job_is_named_as_exited():
    """Issue 34 item 9: rank 1 ran ``os._exit(0)`` at step 3 (no finish event), rank 0 then failed in a
    collective; rank 1 is named as exited, not as "stopped responding", and the summary shows it as ``exit 0``."""
    step = format_event("step", 1, step=3)
    peer = format_event("error", 0, type="RuntimeError", message="Connection closed by peer", peer_failure=True)
    for lines in ([step, rank_exit(1, 0), peer, rank_exit(0, 1)], [step, peer, rank_exit(0, 1), rank_exit(1, 0)]):
        sup, result = supervised(lines)
        assert (result.rank, result.host) == (1, "localhost")
        assert result.message == ("rank 1 exited (exit code 0) in the middle of the job; rank 0 then failed: "
                                  "RuntimeError: Connection closed by peer")
        assert sup.rank_exits == {0: 1, 1: 0}


def test_rank_exit_lines_neighbours():
    """A rank that finished and then exited 0 is still "finished while its peers still needed it"; a rank whose
    kill is announced before torchrun's summary arrives is named from the announcement; a hung rank (no exit
    line) still "stopped responding"; malformed lines change nothing."""
    peer = format_event("error", 0, type="RuntimeError", message="Connection closed by peer", peer_failure=True)
    result = supervise([format_event("finish", 1), rank_exit(1, 0), peer])
    assert result.rank == 1 and result.message.startswith("rank 1 finished while its peers still needed it")
    result = supervise([peer, rank_exit(1, -9)])
    assert result.rank == 1 and result.message == "rank process ended (killed by SIGKILL)"
    junk = ['@zerorun-node {"rank": "1", "exit_code": 0}', '@zerorun-node {"rank": 1, "exit_code": true}',
            "@zerorun-node [1, 0]", "@zerorun-node {not json"]
    result = supervise([format_event("step", 1, step=3), *junk, peer])
    assert result.rank == 1 and result.message.startswith("rank 1 stopped responding (last heard ")


def test_sigterm_sent_to_one_rank_names_the_rank_and_its_host():
    """Issue 34 item 9: every rank saved and stopped because rank 1 (on the second host) got SIGTERM, not the
    launcher: the result names rank 1 and its host; a SIGTERM to the launcher itself, or to every process of
    the job (SLURM's scancel, where each node's torchrun says it got it), stays a job-wide stop."""
    plan = build_plan([Host("localhost", 1), Host("127.0.0.2", 1)], "{}", "job", 12345)
    for launcher_signalled in (False, True, "torchrun"):
        q: queue.Queue = queue.Queue()
        sup = Supervisor(plan, [object(), object()], q, lambda e: None, lambda n, l: None)
        if launcher_signalled == "torchrun":
            q.put(Line(1, TORCHRUN_STOP[0]))
        for rank in (0, 1):
            q.put(Line(rank, format_event("stopped", rank, step=7, steps=80, signal="SIGTERM", path="/ck/step-00000007",
                                      signalled_rank=1)))
        if launcher_signalled is True:
            sup._stop = "SIGTERM"
            while not q.empty():
                sup._drain(0.01)
            result = sup._stopped_result()
        else:
            result = sup._watch()
        tail = " after step 7: every rank saved checkpoint /ck/step-00000007 and exited; continue with zerorun " \
               "train ... --resume"
        if launcher_signalled:
            assert (result.rank, result.host, result.message) == (None, None, "stopped by SIGTERM" + tail)
        else:
            assert (result.status, result.exit_code, result.rank, result.host) == ("interrupted", 143, 1, "127.0.0.2")
            assert result.message == "stopped by SIGTERM (sent to rank 1)" + tail


def test_a_training_rank_that_exits_0_fails_the_job_at_once():
    """Training (``require_finish``) needs every rank to the end: a rank announced as exited 0 without a finish
    event fails the job when announced, before its peers notice (NCCL may wait a collective timeout); a script
    (``zerorun launch``) may end a rank early, and only exit codes decide."""
    plan = build_plan([Host("localhost", 2)], "{}", "job", 12345)
    for require_finish in (True, False):
        q: queue.Queue = queue.Queue()
        sup = Supervisor(plan, [object()], q, lambda e: None, lambda n, l: None, require_finish=require_finish)
        q.put(Line(0, format_event("step", 1, step=3)))
        q.put(Line(0, rank_exit(1, 0)))
        q.put(Line(0, format_event("finish", 0)))  # what the node prints later (so that the loop ends on any code)
        q.put(Line(0, rank_exit(0, 0)))
        q.put(Ended(0, 0))
        result = sup._watch()
        if require_finish:
            assert (result.status, result.rank, result.host) == ("failed", 1, "localhost")
            assert result.message == "rank exited before finishing training (exit code 0, no finish event)"
        else:
            assert result.status == "ok"


def test_torchrun_failure_report_is_data_the_blame_reads():
    """Note [Failure report]: torchrun's ChildFailedError becomes one @zerorun-node line (every failed rank's
    exit code, the first observed failure), which blames as the printed table did; the table alone, a text a
    torch release may reword, decides nothing."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from zerorun.launch.torchrun import failure_report

    failures = {0: ProcessFailure(0, 101, -15, "<N/A>"), 1: ProcessFailure(1, 102, -6, "<N/A>")}
    failures[0].timestamp, failures[1].timestamp = 20, 10
    report = failure_report(ChildFailedError("worker", failures))
    assert report == {"failures": [{"rank": 0, "exit_code": -15}, {"rank": 1, "exit_code": -6}], "root_cause": 1}
    sup, result = supervised(["@zerorun-node " + json.dumps(report)])
    assert (result.rank, result.message) == (1, "rank process ended (killed by SIGABRT)")
    assert sup.rank_exits == {1: -6}  # rank 0: torchrun's SIGTERM after rank 1's failure, shown as stopped
    result = supervise(SUMMARY.splitlines())
    assert (result.rank, result.message) == (None, "node 0 ended (exit code 1): exitcode  : -6 (pid: 102)")


def test_only_the_agent_holding_other_nodes_store_exits_through_teardown():
    """Note [Exit without teardown]: every agent ends at once with os._exit, except node 0 of a job of several
    nodes, whose rendezvous store the other agents may still use for torchrun's exit barrier."""
    from zerorun.launch.torchrun import hosts_store_for_others

    assert hosts_store_for_others(["--nnodes=2", "--node-rank=0", "--master-port=1"])
    assert hosts_store_for_others(["--nnodes", "1:4", "--node-rank", "0"])
    assert not hosts_store_for_others(["--nnodes=2", "--node-rank=1"])
    assert not hosts_store_for_others(["--nnodes=1", "--node-rank=0"])
    assert not hosts_store_for_others(["--nproc-per-node=2", "train.py"])  # torchrun's default: one node


def test_the_continue_command_is_the_launchers_own_line_with_a_bare_resume():
    """Found by review: "continue with zerorun train ... --resume" left the user to rebuild the command line (a
    checkpoint.every override forgotten); launch.env values stay out of it (job.json keeps the message)."""
    from zerorun.launch.supervisor import continue_command

    assert continue_command(["/bin/zerorun", "train", "r.yaml", "checkpoint.every=50", "--resume", "/ck/step-1",
                             "zero.stage=3"]) == "zerorun train r.yaml checkpoint.every=50 zero.stage=3 --resume"
    assert continue_command(["zerorun", "train", "my runs/r.yaml", "--resume=/ck", "launch.env.TOKEN=s3cret",
                             "--no-dashboard"]) == ("zerorun train 'my runs/r.yaml' 'launch.env.TOKEN=<masked>' "
                                                    "--no-dashboard --resume")
    assert continue_command(["zerorun", "launch", "s.py"]) == "zerorun train ... --resume"
