import io
import json

from zerorun.telemetry.events import PREFIX, SCHEMA_VERSION, Event, emit, format_event, parse_line


def test_round_trip():
    out = io.StringIO()
    emit("step", 3, stream=out, step=7, loss=2.5, model_state_bytes={"params": 4})
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1 and line.startswith(PREFIX)
    e = parse_line(line.rstrip("\n"))
    assert (e.kind, e.rank, e.data) == ("step", 3, {"step": 7, "loss": 2.5, "model_state_bytes": {"params": 4}})
    assert e.to_json()["v"] == SCHEMA_VERSION


def test_malformed_and_foreign_lines_are_logs():
    good = format_event("finish", 0, steps=1)
    assert parse_line(good) is not None
    for line in ["plain output", good[:-5], PREFIX + "{", PREFIX + "[1, 2]", PREFIX + "null",
                 PREFIX + json.dumps({"v": 99, "event": "step", "rank": 0}),
                 PREFIX + json.dumps({"v": SCHEMA_VERSION, "event": "bogus", "rank": 0}),
                 PREFIX + json.dumps({"v": SCHEMA_VERSION, "event": "step", "rank": "0"}),
                 PREFIX + "[" * 100000]:
        assert parse_line(line) is None, line


def test_event_behind_a_prefix_from_a_remote_shell():
    assert parse_line("[node 1] " + format_event("start", 2)).rank == 2


def test_model_ready_at_stage_3_is_one_line():
    """Stage 3's units are rank 0's own lines before it (which modules, their bytes, the outer and the root ones);
    before, a second line listed the units, outer units and the root together as "units"."""
    from zerorun.telemetry.format import describe

    ready = Event("model_ready", 0, 0.0, {"params": 34_688, "stage": 3, "units": ["blocks.0", "pos_emb", ""]})
    assert describe(ready) == ["[rank 0] model ready: 34,688 parameters, ZeRO stage 3"]


def test_an_error_that_a_peer_caused_is_one_line_without_its_traceback():
    """A rank killed by SIGKILL made its peer fail in gloo ("Connection reset by peer", a paragraph ending in
    "GLHF!") and the console showed that error with six traceback lines above the line that blames the killed
    rank (a review). A peer failure (Note [Blame] in zerorun/launch/blame.py) is now one line; the rank's own
    errors keep their traceback."""
    from zerorun.telemetry.format import describe

    message = "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:53399: Connection reset by peer\nGLHF!"
    data = {"type": "RuntimeError", "message": message, "traceback": "Traceback\n  File x\n  y\nRuntimeError: boom"}
    assert describe(Event("error", 0, 0.0, {**data, "peer_failure": True})) == [
        "[rank 0] stopped: another rank failed (RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:53399: Connection reset by peer)"]
    own = describe(Event("error", 0, 0.0, data))
    assert own[0] == f"[rank 0] error: RuntimeError: {message}" and own[1:] == [
        "[rank 0]   Traceback", "[rank 0]     File x", "[rank 0]     y", "[rank 0]   RuntimeError: boom"]


def test_an_infinite_or_nan_number_where_a_count_belongs_is_unknown_not_a_traceback(tmp_path):
    """A hand-edited metrics.jsonl with ``"peak_rss_bytes": 1e400`` (JSON reads it as infinity) or ``"step": NaN``
    made ``zerorun show`` end in OverflowError / ValueError from ``int()`` (a review); such a count is unknown."""
    from zerorun.telemetry.events import integer
    from zerorun.telemetry.jobfiles import load_run

    assert [integer({"n": v}, "n") for v in (float("inf"), float("-inf"), float("nan"), 7.9)] == [None, None, None, 7]
    (tmp_path / "metrics.jsonl").write_text(
        '{"v": 1, "event": "step", "rank": 0, "time": 1, "step": 1, "steps": 10, "loss": 1.0, '
        '"peak_rss_bytes": 1e400}\n'
        '{"v": 1, "event": "step", "rank": 0, "time": 2, "step": NaN, "loss": 0.5}\n')
    state, events = load_run(str(tmp_path))
    assert len(events) == 2 and state.step == 1 and state.ranks[0].peak_rss_bytes is None
