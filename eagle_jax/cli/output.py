"""How the generate command's results reach stdout, and how a run cut short ends.

Each result is written as soon as it is finished, whole and flushed, so what came out before a
Ctrl-C or a crash is there and valid (with `--json`, one JSON object a line).

Ctrl-C (SIGINT) stops the run: the lines already written stay whole, one stderr line says how
many of the prompts finished, and the exit status is 130 (128 + SIGINT, what a shell shows for a
command that SIGINT ended). A reader that goes away (`... --json | head -1`) ends the run quietly
with status 0: later lines would go nowhere, and the status should not depend on whether the
reader left before or after the last write (which would make `set -o pipefail` fail at random).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading

INTERRUPTED = 130


class Progress:
    """Counts the finished prompts and writes whole lines to stdout.

    Attributes:
        total: how many prompts the run has (None until they are read).
        finished: how many of them are done and written.
    """

    def __init__(self):
        self.total: int | None = None
        self.finished = 0

    def write_result(self, line: str) -> None:
        """Writes one finished prompt's line, flushed; a Ctrl-C waits until it is out and counted."""
        with sigint_held():
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
            self.finished += 1

    def interrupted(self) -> int:
        """Says on stderr how far the run got; the exit status for a run that Ctrl-C stopped."""
        total = "?" if self.total is None else self.total
        print(f"interrupted: {self.finished} of {total} prompts finished", file=sys.stderr, flush=True)
        return INTERRUPTED


@contextlib.contextmanager
def sigint_held():
    """Holds a Ctrl-C off until the block is done, then raises its KeyboardInterrupt.

    A KeyboardInterrupt raised inside a write could leave half a line in the output, or a line
    that is out but not counted. Only Python's own handler is held, and only on the main thread
    (the only one that can install a handler).
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt


def reader_gone() -> int:
    """After a BrokenPipeError on stdout: the exit status, with stdout pointed at /dev/null.

    Python flushes stdout at exit; into the closed pipe that raises again and prints
    "Exception ignored ... BrokenPipeError" (the remedy the `signal` module's documentation
    gives, "Note on SIGPIPE").
    """
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # a stream with no file behind it
        return 0
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)
    return 0
