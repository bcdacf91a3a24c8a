#!/usr/bin/env bash
# Installs what building and testing the aarch64 kernels on an x86-64 machine needs (docs/building.md,
# "aarch64"): Debian's cross compiler (g++-aarch64-linux-gnu, with the aarch64 C and C++ libraries) and
# qemu-user-static (qemu-aarch64-static runs the aarch64 programs: -cpu cortex-a57, neoverse-n1, max).
# Idempotent, as install_mpi.sh: nothing when they are installed; apt-get update only when needed.
# custom_ops/arm64.sh and CI (.ci/run) use it; an aarch64 machine needs none of it.
set -euo pipefail

PACKAGES=(g++-aarch64-linux-gnu qemu-user-static)
here=.
[[ ${BASH_SOURCE[0]} == */* ]] && here=${BASH_SOURCE[0]%/*}
# shellcheck source=apt_packages.sh
source "$here/apt_packages.sh"

other_systems() {
    cat >&2 <<'MSG'
Install an aarch64 Linux cross compiler (with its C and C++ libraries) and qemu's user-mode emulator another
way, then run this again:
  Fedora:  dnf install gcc-c++-aarch64-linux-gnu sysroot-aarch64-fc*-glibc qemu-user-static-aarch64
  Arch:    pacman -S aarch64-linux-gnu-gcc qemu-user-static
  Ubuntu:  apt-get install g++-aarch64-linux-gnu qemu-user-static
custom_ops/arm64.sh expects aarch64-linux-gnu-g++ and qemu-aarch64-static on PATH and the C library under
/usr/aarch64-linux-gnu (cmake/aarch64-linux-gnu.cmake: MOE_ONNX_ARM64_PREFIX, MOE_ONNX_ARM64_SYSROOT).
MSG
}

tools_on_path() { command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64-static >/dev/null; }

if ! command -v apt-get >/dev/null || ! command -v dpkg-query >/dev/null; then
    if tools_on_path; then
        echo "install_arm64_tools: not a Debian-family system; using aarch64-linux-gnu-g++ and qemu-aarch64-static on PATH"
        exit 0
    fi
    echo "install_arm64_tools: no apt-get here (not a Debian-family system) and no aarch64 cross tools on PATH." >&2
    other_systems
    exit 1
fi

if packages_installed "${PACKAGES[@]}"; then
    echo "install_arm64_tools: ${PACKAGES[*]} already installed"
    exit 0
fi

install_debian_packages install_arm64_tools "${PACKAGES[@]}" || exit 1
echo "install_arm64_tools: installed ${PACKAGES[*]} ($(aarch64-linux-gnu-g++ --version | head -n 1))"
