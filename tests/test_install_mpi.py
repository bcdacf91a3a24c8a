"""scripts/install_mpi.sh on stand-in package tools: what it runs (apt-get update only when needed,
nothing when MPI is installed) and what it says where it cannot install; and scripts/install_arm64_tools.sh, which
installs the same way (scripts/apt_packages.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # the script, in bash

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install_mpi.sh"
ARM64_SCRIPT = SCRIPT.with_name("install_arm64_tools.sh")
TOOLS = ("bash", "cat", "env", "grep", "head")  # the real commands the script uses besides the package tools


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f'#!/bin/bash\necho "{name} $*" >> "$CALLS"\n{body}\n')
    path.chmod(0o755)


def _machine(tmp_path: Path, *, apt: bool = True, installed: bool = False, known: bool = True,
             install_fails_once: bool = False, root: bool = True, sudo: bool = False) -> dict:
    """A PATH of stand-ins for the package tools (each logs its calls to $CALLS) and the real TOOLS."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    state = tmp_path / "installed"
    if installed:
        state.touch()
    _stub(bin_dir, "id", f"echo {0 if root else 1000}")
    _stub(bin_dir, "mpiexec", "echo 'mpiexec (OpenRTE) 4.1.4'")
    _stub(bin_dir, "aarch64-linux-gnu-g++", "echo 'aarch64-linux-gnu-g++ (Debian 12.2.0-14) 12.2.0'")
    if sudo:
        _stub(bin_dir, "sudo", '"$@"')
    if apt:
        _stub(bin_dir, "dpkg-query", f'[[ -e {state} ]] && echo -n "install ok installed" || exit 1')
        updated = tmp_path / "updated"
        known_after = "true" if known else f"[[ -e {updated} ]]"  # apt knows the packages (after an update)
        _stub(bin_dir, "apt-cache", f"{known_after} && echo '  Candidate: 4.1.4-3' || echo '  Candidate: (none)'")
        failing = f"[[ -e {updated} ]] || exit 100" if install_fails_once else ""
        _stub(bin_dir, "apt-get", f'if [[ $1 == update ]]; then : > {updated}; exit 0; fi\n{failing}\n: > {state}')
    return {"PATH": str(bin_dir), "CALLS": str(tmp_path / "calls")}


def _run(env: dict, script: Path = SCRIPT) -> tuple[int, str, list[str]]:
    result = subprocess.run([shutil.which("bash"), str(script)], env=env, capture_output=True, text=True, timeout=60)
    calls = Path(env["CALLS"]).read_text().splitlines() if os.path.exists(env["CALLS"]) else []
    apt_calls = [c for c in calls if c.startswith(("apt-get", "sudo"))]
    return result.returncode, result.stdout + result.stderr, apt_calls


INSTALL = "apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev"


@pytest.mark.parametrize("setting, expected_calls", [
    ({"installed": True}, []),
    ({}, [INSTALL]),
    ({"known": False}, ["apt-get update", INSTALL]),
    ({"install_fails_once": True}, [INSTALL, "apt-get update", INSTALL]),
    ({"root": False, "sudo": True}, [f"sudo env DEBIAN_FRONTEND=noninteractive {INSTALL}", INSTALL]),
])
def test_installs_with_apt_and_updates_only_when_needed(tmp_path, setting, expected_calls):
    code, output, calls = _run(_machine(tmp_path, **setting))
    assert code == 0, output
    assert calls == expected_calls
    assert ("already installed" in output) == bool(setting.get("installed"))


def test_not_root_without_sudo_names_the_command(tmp_path):
    code, output, calls = _run(_machine(tmp_path, root=False))
    assert code == 1 and calls == []
    assert "needs root" in output and f"apt-get update && {INSTALL}" in output


def test_without_apt_names_what_to_install(tmp_path):
    code, output, calls = _run(_machine(tmp_path, apt=False))
    assert code == 1 and calls == []
    assert "not a Debian-family system" in output
    for other in ("dnf install openmpi", "brew install open-mpi", "conda install -c conda-forge openmpi"):
        assert other in output
    assert "everything else runs without it" in output


def test_without_apt_uses_an_mpi_on_path(tmp_path):
    env = _machine(tmp_path, apt=False)
    _stub(Path(env["PATH"]), "mpicc", "")
    code, output, _ = _run(env)
    assert code == 0 and "using the MPI already on PATH" in output


ARM64_INSTALL = "apt-get install -y --no-install-recommends g++-aarch64-linux-gnu qemu-user-static"


@pytest.mark.parametrize("setting, expected_calls, said", [
    ({"installed": True}, [], "already installed"),
    ({"known": False}, ["apt-get update", ARM64_INSTALL], "installed g++-aarch64-linux-gnu qemu-user-static"),
])
def test_arm64_tools_install_as_mpi_does(tmp_path, setting, expected_calls, said):
    code, output, calls = _run(_machine(tmp_path, **setting), ARM64_SCRIPT)
    assert code == 0, output
    assert calls == expected_calls and said in output


def test_arm64_tools_apt_failure_names_other_systems(tmp_path):
    env = _machine(tmp_path)
    _stub(Path(env["PATH"]), "apt-get", "exit 100")  # every install fails, before and after an update
    code, output, calls = _run(env, ARM64_SCRIPT)
    assert code == 1 and calls == [ARM64_INSTALL, "apt-get update", ARM64_INSTALL]
    assert "could not install g++-aarch64-linux-gnu qemu-user-static" in output and "Fedora:" in output
