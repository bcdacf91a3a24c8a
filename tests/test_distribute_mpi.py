"""MoeDistributeDispatch -> expert -> MoeDistributeCombine on the C++ kernels over 2 and 4 MPI ranks
(tests/mpi/distribute_driver.py, one mpirun launch per rank count), against the all-ranks reference:
expand_x, expert_offset and assist_info element for element, out within 1e-6, for EP, TP and EP x TP
layouts, dropless and drop/pad, uneven loads, ranks with no tokens or no rows, T = 0 and 1,
gather_tokens 0 and 1, float32/float16/bfloat16."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "mpi" / "distribute_driver.py"
sys.path.insert(0, str(DRIVER.parent))
from distribute_driver import configurations  # noqa: E402

COMM_TIMEOUT_S = "60"  # a kernel that hangs fails the launch in bounded time


def launch(ranks: int, out_dir: Path) -> list[dict]:
    """Every rank's report of one mpirun launch of the driver."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun is not on PATH: the multi-rank tests need Open MPI (apt-get install openmpi-bin "
                    "libopenmpi-dev; docs/distributed.md)")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1", "MOE_ONNX_COMM_TIMEOUT_S": COMM_TIMEOUT_S,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([mpirun, "--oversubscribe", "-n", str(ranks), sys.executable, str(DRIVER), str(out_dir)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mpirun -n {ranks} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return [json.loads((out_dir / f"rank{g}.json").read_text()) for g in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_dispatch_combine_match_the_reference_on_every_rank(ranks, tmp_path):
    reports = launch(ranks, tmp_path)
    names = [c["name"] for c in configurations(ranks)]
    failures = []
    for report in reports:
        assert report["world"] == ranks
        assert [r["name"] for r in report["results"]] == names, "every rank ran every configuration"
        failures += [f"rank {report['rank']} {r['name']}: {p}" for r in report["results"] for p in r["problems"]]
    assert not failures, "\n".join(failures)
    results = [r for report in reports for r in report["results"]]
    assert any(r["dropped"] for r in results), "some configuration drops slots"
    assert any(r["rows"] == 0 for r in results) and any(r["rows"] > 20 for r in results)
