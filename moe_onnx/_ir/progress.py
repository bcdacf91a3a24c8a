"""Progress a person can read: stage messages, and long loops (writing weights, packing) counted.

A command reports through a callable ``progress(message)``. The command line's is a :class:`Progress`: each stage
one line with the seconds since the command started, and each counted loop one bar redrawn in place on a terminal,
or, in a log (stderr not a terminal), a line at each quarter done (at most one per 10 s, and the last). Any other
callable (a test's, the Python API's) receives the stage messages and a counted loop's lines as a log does
(:func:`counter`): a few lines, never one per tensor.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

_BAR_WIDTH = 30
_REDRAW_SECONDS = 0.2
#: in a log, a counted loop's lines are this many seconds apart at least (its last line always comes)
LOG_SECONDS = 10.0


class Progress:
    """The command line's progress: stage lines and counted bars on ``stream`` (stderr), a bar when ``terminal``
    (default: whether the stream is one)."""

    def __init__(self, stream: TextIO | None = None, terminal: bool | None = None):
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self._start = time.perf_counter()
        self._bar_open = False

    def _stamp(self) -> str:
        return f"[{time.perf_counter() - self._start:7.1f}s]"

    def __call__(self, message: str) -> None:
        self._close_bar()
        print(f"{self._stamp()} {message}", file=self.stream, flush=True)

    def counter(self, what: str, total: int, unit: str = "") -> Callable[[int], None]:
        """``advance(done)`` for a loop of ``total`` steps (bytes, tensors, rules; ``unit`` names them)."""
        if not self.terminal:
            return _quarter_lines(self, what, total, unit)
        last = [0.0]

        def advance(done: int) -> None:
            now = time.perf_counter()
            if done < total and now - last[0] < _REDRAW_SECONDS:
                return
            last[0] = now
            filled = _BAR_WIDTH * done // max(total, 1)
            bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
            print(f"\r{self._stamp()} {what} [{bar}] {100 * done // max(total, 1):3d}% {_amount(done, unit)}/"
                  f"{_amount(total, unit)}", end="", file=self.stream, flush=True)
            self._bar_open = done < total
            if done >= total:
                print(file=self.stream, flush=True)

        return advance

    def _close_bar(self) -> None:
        if self._bar_open:
            print(file=self.stream, flush=True)
            self._bar_open = False


def _amount(count: int, unit: str) -> str:
    if unit == "bytes":
        for size, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if count >= size:
                return f"{count / size:.2f} {name}" if size == 2**30 else f"{count / size:.0f} {name}"
        return f"{count} bytes"
    return f"{count}{f' {unit}' if unit else ''}"


def _quarter_lines(say: Callable[[str], None], what: str, total: int, unit: str) -> Callable[[int], None]:
    """A line when a quarter of the loop is done, at most one per LOG_SECONDS but the last (a short loop: one)."""
    marks = sorted({-(-total * quarter // 4) for quarter in range(1, 5)})
    state = {"said": 0, "at": time.perf_counter()}

    def advance(done: int) -> None:
        reached = sum(1 for mark in marks if mark <= done)
        now = time.perf_counter()
        if reached > state["said"] and (done >= total or now - state["at"] >= LOG_SECONDS):
            state["said"], state["at"] = reached, now
            say(f"{what}: {_amount(done, unit)}/{_amount(total, unit)}")

    return advance


def counter(progress: Callable[[str], None] | None, what: str, total: int,
            unit: str = "") -> Callable[[int], None]:
    """``advance(done)`` for a loop of ``total`` steps reported to ``progress``: a bar of a :class:`Progress`, a line
    at each quarter to any other callable, nothing to None."""
    if progress is None:
        return lambda done: None
    if isinstance(progress, Progress):
        return progress.counter(what, total, unit)
    return _quarter_lines(progress, what, total, unit)
