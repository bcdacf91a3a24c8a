# Sourced by the install scripts (install_mpi.sh, install_arm64_tools.sh): Debian packages installed
# idempotently, apt-get update run only when apt does not know a package or an install from the lists it
# has fails.
#   packages_installed PACKAGE...          true when dpkg lists every one as installed
#   install_debian_packages TAG PACKAGE...  installs them (as root, or through sudo), printing TAG: ...;
#                                          returns 1 when it cannot run as root, or when apt-get failed
#                                          after an update (then it calls the caller's other_systems first,
#                                          which names other ways to install)

packages_installed() {
    local package status
    for package in "$@"; do
        status=$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null) || return 1
        [[ $status == "install ok installed" ]] || return 1
    done
}

install_debian_packages() {
    local tag=$1
    shift
    local packages=("$@") as_root=() package updated=0
    if [[ $(id -u) -ne 0 ]]; then
        if ! command -v sudo >/dev/null; then
            echo "$tag: installing ${packages[*]} needs root; run as root:" >&2
            echo "  apt-get update && apt-get install -y --no-install-recommends ${packages[*]}" >&2
            return 1
        fi
        echo "$tag: not root, using sudo"
        as_root=(sudo)
    fi
    for package in "${packages[@]}"; do
        if ! apt-cache policy "$package" 2>/dev/null | grep -q 'Candidate: [^(]'; then
            "${as_root[@]}" apt-get update
            updated=1
            break
        fi
    done
    if "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "${packages[@]}"; then
        return 0
    fi
    if [[ $updated -eq 0 ]]; then
        echo "$tag: the install failed with the package lists apt had; updating them and trying again"
        "${as_root[@]}" apt-get update
        "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            "${packages[@]}" && return 0
    fi
    echo "$tag: apt-get could not install ${packages[*]}." >&2
    other_systems
    return 1
}
