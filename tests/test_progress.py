"""Progress a person can read (moe_onnx/_ir/progress.py): stage lines, a counted loop as one bar redrawn in place on
a terminal, and as a few lines in a log (a quarter at a time, at most one per LOG_SECONDS, and the last)."""

from __future__ import annotations

import io
import re

from moe_onnx._ir import progress as progress_module
from moe_onnx._ir.progress import Progress, counter


def test_a_log_gets_a_line_a_quarter_not_one_per_step(monkeypatch):
    """10,000 steps in a log: the stage line, then a line at each quarter (the clock moving 10 s a step, so none is
    held back), never one per step; the amounts in MiB and GiB."""
    clock = iter(range(0, 10**6, 10))
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    say = Progress(stream, terminal=False)
    say("writing model.onnx")
    advance = say.counter("writing the weights", 4 << 30, "bytes")
    for step in range(1, 10_001):
        advance(step * (4 << 30) // 10_000)
    lines = [re.sub(r"^\[ *[\d.]+s\] ", "", line) for line in stream.getvalue().splitlines()]
    assert lines == ["writing model.onnx", "writing the weights: 1.00 GiB/4.00 GiB",
                     "writing the weights: 2.00 GiB/4.00 GiB", "writing the weights: 3.00 GiB/4.00 GiB",
                     "writing the weights: 4.00 GiB/4.00 GiB"]


def test_a_fast_loop_in_a_log_says_its_end_only():
    """A loop done within LOG_SECONDS gives one line, its last; a callable that is not a Progress gets the same
    lines (the Python API's, a test's)."""
    lines = []
    advance = counter(lines.append, "checking", 40, "nodes")
    for done in range(1, 41):
        advance(done)
    assert lines == ["checking: 40 nodes/40 nodes"]
    counter(None, "nothing", 3)(3)  # no progress asked for: nothing, no error


def test_a_terminal_gets_one_bar_redrawn_in_place():
    """On a terminal a counted loop is one line redrawn with carriage returns, ended by a newline once done; a stage
    message during a bar starts on a line of its own."""
    stream = io.StringIO()
    say = Progress(stream, terminal=True)
    advance = say.counter("packing", 4, "nodes")
    advance(1)
    say("a stage")
    advance(4)
    text = stream.getvalue()
    first, stage, last = text.split("\n")[:3]
    assert first.startswith("\r[") and "packing [#######-----------------------]  25% 1 nodes/4 nodes" in first
    assert stage.endswith("] a stage")
    assert last.startswith("\r[") and last.endswith("packing [##############################] 100% 4 nodes/4 nodes")
    assert text.endswith("\n") and text.count("\n") == 3
