"""MoeDistributeDispatch -> expert -> MoeDistributeCombine on the C++ kernels over 2 and 4 MPI ranks
(tests/mpi/distribute_driver.py, one mpirun launch per rank count), against the all-ranks reference:
expand_x, expert_offset and assist_info element for element, out within 1e-6, for EP, TP and EP x TP
layouts, dropless and drop/pad, uneven loads, ranks with no tokens or no rows, T = 0 and 1,
gather_tokens 0 and 1, float32/float16/bfloat16. Without mpirun the test fails, saying so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mpi.distribute_driver import configurations

DRIVER = Path(__file__).resolve().parent / "mpi" / "distribute_driver.py"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_dispatch_combine_match_the_reference_on_every_rank(ranks, tmp_path, mpirun):
    launch = mpirun(ranks, sys.executable, str(DRIVER), str(tmp_path), timeout=600, MOE_ONNX_COMM_TIMEOUT_S="60")
    assert launch.returncode == 0, launch.stdout[-3000:] + launch.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{g}.json").read_text()) for g in range(ranks)]
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
