"""What the test modules share.

Helpers are plain modules (tests/ and models/ are on pytest's ``pythonpath``, pyproject.toml); no test
module imports another:

* ``cases/``: one case table per op (:class:`cases.Case`, ``ALL_CASES``, ``VALID_CASES``, ``ORACLES``),
  ``covering`` (a representative subset of a table) and ``lanes`` (a table's cases, those outside such
  a subset marked slow);
* ``backends.py``: a case on the C++ or the Python kernels, their errors, and the sessions tests build
  (``cached_session``: a model run again soon after is not built again; ``options``);
* ``fixture_models.py``: the committed export fixtures: loading, optimizing (the one cache of optimized
  fixtures), running, reading and mutating them; ``fixture_lanes`` (all but FAST_FIXTURES marked slow);
* ``decoders.py``: exported decoders run step by step with their KV cache, against transformers' tokens;
* ``distributed_models.py``, ``world_simulation.py``: the distributed tests' models and every rank in one
  process; ``ort_contrib_reference.py``: onnxruntime's contrib MoE/QMoE in numpy;
* ``mpi/``: the drivers :func:`mpirun` launches.

Fixtures: ``mpirun``; ``sessions_alive_at_creation`` (how many sessions made during a test were alive when each next
one was created); ``genai_optimized``, the onnxruntime-genai builder folders (models/fixtures/genai) optimized
once per run (test_genai_models.py, test_generate.py); ``exported``, checkpoints exported once per run (the tests
that share them are in the xdist group "export": one worker makes each export once).

Markers (pyproject.toml): ``slow`` (left out of the fast lane ``pytest -m "not slow"``), ``mpi``,
``subprocess``, ``fuzz``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import backends
import onnxruntime as ort
import pytest
from _pytest import nodes

ROOT = Path(__file__).resolve().parents[1]

# The suite starts ~100 Python processes (mpirun's ranks, the command line, the kernels at each ISA level), each
# importing moe_onnx: its compiled modules are written once (__pycache__/, ignored by git) and read by every later
# process, and each test module's assertion rewrite is done once, even where PYTHONDONTWRITEBYTECODE is set.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

ort.set_default_logger_severity(4)  # the tests assert onnxruntime's errors; they are not logged

backends.sessions_do_not_spin()  # every session the tests build, moe_onnx's and plain onnxruntime's


def pytest_configure(config: pytest.Config) -> None:
    """Refuse ``--dist loadgroup`` under a pytest whose test ids pytest-xdist cannot suffix with their group (it
    sets ``Node._nodeid``, which pytest 9.2 no longer has): every xdist_group would be split over the workers
    silently, and each worker would repeat what the group's tests share (exports, kernel children)."""
    if (config.getoption("dist", "no") == "loadgroup" and config.getoption("numprocesses", None)
            and not hasattr(nodes.Node, "_nodeid")):
        raise pytest.UsageError(f"pytest-xdist cannot group tests (xdist_group) under pytest {pytest.__version__}: "
                                "install the pytest that pyproject.toml's test extra pins (pip install -e '.[test]')")


def mpi_environment(**env: str) -> dict[str, str]:
    """The environment of an mpirun launch: this checkout importable, one thread per rank, oversubscribed
    (more ranks than cores), allowed as root; ``env`` on top."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_rmaps_base_oversubscribe": "1", **env}


@pytest.fixture
def mpirun() -> Callable[..., subprocess.CompletedProcess]:
    """``mpirun(ranks, *command, timeout=..., **env)``: one launch of ``command`` on ``ranks`` ranks
    (:func:`mpi_environment`), its output captured. Fails the test, saying what to install, when
    mpirun or mpi4py is missing: CI installs both (docs/distributed.md)."""
    launcher = shutil.which("mpirun")
    if launcher is None:
        pytest.fail("mpirun not found: the multi-rank tests need Open MPI (apt-get install openmpi-bin "
                    "libopenmpi-dev; docs/building.md)")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.fail("mpi4py is not installed in this Python (pip install mpi4py): the multi-rank tests need it")

    def launch(ranks: int, *command: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([launcher, "-n", str(ranks), *command], env=mpi_environment(**env),
                              capture_output=True, text=True, timeout=timeout)

    return launch


@pytest.fixture
def sessions_alive_at_creation(monkeypatch) -> list[int]:
    """For each onnxruntime session created during the test (every ``onnxruntime.InferenceSession``, those of
    ``moe_onnx.session`` included), in order: how many of those created before it were still alive (not yet
    freed) at that moment. A tool that holds one session at a time gives all zeros."""
    made: list[weakref.ref] = []
    alive_at_creation: list[int] = []

    class Tracked(ort.InferenceSession):
        def __init__(self, *args, **kwargs):
            alive_at_creation.append(sum(ref() is not None for ref in made))
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(ort, "InferenceSession", Tracked)
    return alive_at_creation


@pytest.fixture(scope="session")
def genai_optimized(tmp_path_factory) -> dict[str, Path]:
    """Each onnxruntime-genai builder folder of models/fixtures/genai optimized (target moe) by `moe-onnx optimize
    FOLDER -o OUT`, by name; shared: copy a folder before changing it."""
    from moe_onnx.cli import main as cli

    fixtures, out = ROOT / "models" / "fixtures" / "genai", tmp_path_factory.mktemp("genai_optimized")
    names = sorted(folder.name for folder in fixtures.iterdir())
    for name in names:
        assert cli(["optimize", str(fixtures / name), "-o", str(out / name)]) == 0
    return {name: out / name for name in names}



@pytest.fixture(scope="session")
def exported(tmp_path_factory) -> Callable[..., Path]:
    """``exported(checkpoint, *options)``: the folder ``moe-onnx export CHECKPOINT -o OUT *options`` writes (it must
    exit 0), made once per run and worker; shared: copy a folder before changing it. Tests that use it belong to
    the xdist group "export", so that one worker makes each export once."""
    from moe_onnx.cli import main as cli

    made: dict[tuple[str, ...], Path] = {}
    out = tmp_path_factory.mktemp("exported")

    def export(checkpoint: Path, *options: str) -> Path:
        key = (str(checkpoint), *options)
        if key not in made:
            folder = out / str(len(made))
            assert cli(["export", str(checkpoint), "-o", str(folder), *options]) == 0
            made[key] = folder
        return made[key]

    return export
