#!/usr/bin/env bash
# Installs Open MPI from the system's packages (Debian family: openmpi-bin, libopenmpi-dev), for the
# distributed ops and `moe-onnx run` (docs/distributed.md). Idempotent: does nothing when they are
# installed, and runs `apt-get update` only when apt does not know the packages or an install from
# the lists it has fails. One process needs none of this: moe_onnx installs and runs without MPI.
set -euo pipefail

PACKAGES=(openmpi-bin libopenmpi-dev)
here=.
[[ ${BASH_SOURCE[0]} == */* ]] && here=${BASH_SOURCE[0]%/*}
# shellcheck source=apt_packages.sh
source "$here/apt_packages.sh"

other_systems() {
    cat >&2 <<'MSG'
Install an MPI library with its compiler wrappers and headers another way, then run the set-up again:
  Fedora/RHEL: dnf install openmpi openmpi-devel (then `module load mpi/openmpi-x86_64`)
  Arch:        pacman -S openmpi
  macOS:       brew install open-mpi
  conda:       conda install -c conda-forge openmpi
MPI is needed only past one process (docs/distributed.md); everything else runs without it.
MSG
}

if ! command -v apt-get >/dev/null || ! command -v dpkg-query >/dev/null; then
    if command -v mpicc >/dev/null && command -v mpiexec >/dev/null; then
        echo "install_mpi: not a Debian-family system; using the MPI already on PATH ($(command -v mpiexec))"
        exit 0
    fi
    echo "install_mpi: no apt-get here (not a Debian-family system) and no MPI (mpicc, mpiexec) on PATH." >&2
    other_systems
    exit 1
fi

if packages_installed "${PACKAGES[@]}"; then
    echo "install_mpi: ${PACKAGES[*]} already installed ($(mpiexec --version 2>/dev/null | head -n 1))"
    exit 0
fi

install_debian_packages install_mpi "${PACKAGES[@]}" || exit 1
echo "install_mpi: installed ${PACKAGES[*]} ($(mpiexec --version | head -n 1))"
