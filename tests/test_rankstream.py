"""A rank's stdout/stderr (Note [Rank streams] in telemetry/rankstream.py) behave as the text streams a script
gets under plain torchrun, with each line prefixed; in one process, over a pipe."""

import faulthandler
import io
import os

import pytest

from zerorun.telemetry import rankstream


@pytest.fixture
def pipe_stream():
    """``(stream, read)``: a rank-3 stream over a pipe's write end, and a function returning what reached it."""
    r, w = os.pipe()
    original = io.TextIOWrapper(io.FileIO(w, "wb"), encoding="utf-8", errors="strict", write_through=True)
    stream = rankstream.rank_stream(original, 3)

    def read() -> str:
        stream.flush()
        os.set_blocking(r, False)
        try:
            return os.read(r, 1 << 16).decode()
        except BlockingIOError:
            return ""

    yield stream, read
    stream.close()
    original.close()
    os.close(r)


def test_the_text_stream_api_a_script_uses(pipe_stream):
    stream, read = pipe_stream
    assert isinstance(stream, io.TextIOBase)
    assert (stream.encoding, stream.errors, stream.isatty(), stream.writable()) == ("utf-8", "strict", False, True)
    assert (stream.name, stream.mode, stream.readable(), stream.seekable()) == (stream.fileno(), "w", False, False)
    stream.write("a\nb")
    assert read() == "[rank 3] a\n"  # the partial line waits for its end
    print("c", file=stream)
    stream.writelines(["d\n", "e", "\n"])
    assert read() == "[rank 3] bc\n[rank 3] d\n[rank 3] e\n"
    stream.buffer.write("é bytes\n".encode())  # sys.stdout.buffer.write(...): prefixed like text
    stream.buffer.flush()
    assert read() == "[rank 3] é bytes\n"
    for bad in ("text", 5):
        with pytest.raises(TypeError):
            stream.buffer.write(bad)
    stream.reconfigure(line_buffering=True)
    assert stream.line_buffering
    stream.reconfigure(errors="replace")
    stream.write("\udcff\n")
    assert read() == "[rank 3] ?\n"
    stream.write("no newline")
    stream.close()  # the last partial line is still written
    assert stream.closed


def test_fileno_is_the_real_descriptor_for_faulthandler(pipe_stream, tmp_path):
    stream, read = pipe_stream
    fd = stream.fileno()
    assert fd == stream.buffer.fileno() and os.fstat(fd)
    faulthandler.enable(file=stream)  # what faulthandler.enable() does with sys.stderr
    try:
        faulthandler.dump_traceback(file=stream)
    finally:
        faulthandler.disable()
    assert "test_fileno_is_the_real_descriptor_for_faulthandler" in read()  # written to the fd, unprefixed


def test_finish_writes_the_last_partial_line(pipe_stream, monkeypatch):
    stream, read = pipe_stream
    monkeypatch.setattr("sys.stdout", stream)
    monkeypatch.setattr("sys.stderr", io.StringIO())  # a stream without a LineBuffer is only flushed
    print("progress 50%", end="")
    rankstream.finish()
    assert read() == "[rank 3] progress 50%\n"
    rankstream.finish()
    assert read() == ""


def test_a_stream_without_a_descriptor_is_left_as_it_is():
    s = io.StringIO()
    assert rankstream.rank_stream(s, 0) is s


@pytest.mark.parametrize("fails", [False, True])
def test_a_training_rank_writes_its_last_partial_line(pipe_stream, monkeypatch, fails):
    """The train worker (zerorun.rank.worker) ends its streams as a script's rank does: a model's progress
    print without a newline is shown, after a success or a failure (it was lost: only the script worker
    finished them)."""
    from zerorun.rank import worker
    from zerorun.zero import allocator

    stream, read = pipe_stream
    monkeypatch.setattr(allocator, "configure", lambda: None)
    monkeypatch.setattr(rankstream, "install", lambda rank: monkeypatch.setattr("sys.stdout", stream))
    monkeypatch.setattr(worker, "read_recipe", lambda path: None)

    def train(recipe, rank):
        print("progress 50%", end="")
        if fails:
            raise RuntimeError("boom")

    monkeypatch.setattr(worker, "train", train)
    assert worker.main(["--recipe-file", "unused"]) == (1 if fails else 0)
    assert read() == "[rank 3] progress 50%\n"
