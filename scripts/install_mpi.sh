#!/usr/bin/env bash
# Installs Open MPI from the system's packages (Debian family: openmpi-bin, libopenmpi-dev), for the
# distributed ops and `moe-onnx run` (docs/distributed.md). Idempotent: does nothing when they are
# installed, and runs `apt-get update` only when apt does not know the packages or an install from
# the lists it has fails. One process needs none of this: moe_onnx installs and runs without MPI.
set -euo pipefail

PACKAGES=(openmpi-bin libopenmpi-dev)

installed() {
    local status
    for package in "${PACKAGES[@]}"; do
        status=$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null) || return 1
        [[ $status == "install ok installed" ]] || return 1
    done
}

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

if installed; then
    echo "install_mpi: ${PACKAGES[*]} already installed ($(mpiexec --version 2>/dev/null | head -n 1))"
    exit 0
fi

as_root=()
if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null; then
        echo "install_mpi: installing ${PACKAGES[*]} needs root; run as root:" >&2
        echo "  apt-get update && apt-get install -y --no-install-recommends ${PACKAGES[*]}" >&2
        exit 1
    fi
    echo "install_mpi: not root, using sudo"
    as_root=(sudo)
fi

apt_install() {
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "${PACKAGES[@]}"
}

known_to_apt() {
    for package in "${PACKAGES[@]}"; do
        apt-cache policy "$package" 2>/dev/null | grep -q 'Candidate: [^(]' || return 1
    done
}

updated=0
if ! known_to_apt; then
    "${as_root[@]}" apt-get update
    updated=1
fi
if ! apt_install; then
    if [[ $updated -eq 1 ]]; then
        echo "install_mpi: apt-get could not install ${PACKAGES[*]}." >&2
        other_systems
        exit 1
    fi
    echo "install_mpi: the install failed with the package lists apt had; updating them and trying again"
    "${as_root[@]}" apt-get update
    apt_install
fi
echo "install_mpi: installed ${PACKAGES[*]} ($(mpiexec --version | head -n 1))"
