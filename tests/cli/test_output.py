"""The generate command's output: whole, counted lines even under Ctrl-C, and how a cut-short run ends."""

import io
import signal

import pytest

from eagle_jax.cli import output


class InterruptedStream(io.StringIO):
    """A stdout that receives a Ctrl-C in the middle of every write."""

    def __init__(self):
        super().__init__()
        self.flushes = 0

    def write(self, text):
        signal.raise_signal(signal.SIGINT)  # delivered to this (the main) thread, before the text is written
        return super().write(text)

    def flush(self):
        self.flushes += 1


def test_a_ctrl_c_during_a_write_waits_until_the_line_is_out_and_counted(monkeypatch):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    stream = InterruptedStream()
    monkeypatch.setattr("sys.stdout", stream)
    progress = output.Progress()
    with pytest.raises(KeyboardInterrupt):
        progress.write_result('{"index": 0}')
    assert stream.getvalue() == '{"index": 0}\n' and stream.flushes == 1 and progress.finished == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's handler is back


def test_the_interrupted_line_says_how_far_the_run_got(capsys):
    progress = output.Progress()
    assert progress.interrupted() == 130
    assert capsys.readouterr().err == "interrupted: 0 of ? prompts finished\n"
    progress.total, progress.finished = 5, 2
    assert progress.interrupted() == 130
    assert capsys.readouterr().err == "interrupted: 2 of 5 prompts finished\n"


def test_a_reader_gone_is_a_quiet_success(monkeypatch):
    monkeypatch.setattr("sys.stdout", io.StringIO())  # no descriptor to point at /dev/null
    assert output.reader_gone() == 0
