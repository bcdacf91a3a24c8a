"""benchmarks/run.py, the one way to list and run the benchmarks: it lists every script of benchmarks/ with what it
measures, runs one by its short name with its own arguments, and refuses a name it does not know."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RUNNER = runpy.run_path(str(BENCHMARKS / "run.py"))


def test_lists_every_benchmark_with_what_it_measures(capsys):
    assert RUNNER["main"](["--list"]) == 0
    listed = capsys.readouterr().out
    scripts = [p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_") and p.name != "run.py"]
    assert scripts and len(RUNNER["benchmarks"]()) == len(scripts)
    for script in scripts:
        name = script.stem.removeprefix("bench_")
        summary = RUNNER["summary"](script)
        assert summary, f"{script.name} has no docstring saying what it measures"
        assert any(line.startswith(f"{name} ") for line in listed.splitlines()), f"{name} is not listed"


def test_runs_a_benchmark_with_its_arguments(monkeypatch):
    """A script run by name sees its own arguments (here bench_moe's --help, which exits before any work)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as exited:
        RUNNER["main"](["moe", "--help"])
    assert exited.value.code == 0


def test_an_unknown_name_is_refused(capsys):
    assert RUNNER["main"](["nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("benchmarks/run.py: no benchmark 'nope'; `python benchmarks/run.py --list` lists them (")
    assert "bf16_compute, " in err
