#!/bin/sh
# Fetch onnxruntime's C/C++ headers from a newer Debian release's libonnxruntime-dev package and
# extract them into DEST, without touching the system: a private apt configuration (its own
# sources list, state, cache and lists directories) points at the mirror the machine already uses,
# with the suite SUITE; `apt-get download` fetches the .deb and `dpkg -x` unpacks it into DEST.
# Nothing is installed. Prints the include directory on success.
#
# usage: debian_ort_headers.sh DEST [SUITE]      (SUITE defaults to trixie)
set -eu
dest=$1
suite=${2:-trixie}
command -v apt-get >/dev/null 2>&1 || { echo "apt-get not found: not a Debian-family machine" >&2; exit 2; }
command -v dpkg >/dev/null 2>&1 || { echo "dpkg not found" >&2; exit 2; }

# The machine's own Debian mirror: the first URIs: line of a deb822 source, else a deb line of
# sources.list, that serves the main archive (not the security one).
mirror=""
for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    uri=$(awk 'tolower($1) == "uris:" { for (i = 2; i <= NF; i++) print $i }' "$f" | grep -v -- '-security' | grep '/debian/\?$' | head -n 1 || true)
    if [ -n "$uri" ]; then mirror=$uri; break; fi
done
if [ -z "$mirror" ]; then
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z+]+:\/\//) { print $i; break } }' "$f" | grep -v -- '-security' | grep '/debian/\?$' | head -n 1 || true)
        if [ -n "$uri" ]; then mirror=$uri; break; fi
    done
fi
[ -n "$mirror" ] || { echo "no Debian mirror found in /etc/apt sources" >&2; exit 2; }

keyring=""
for k in /usr/share/keyrings/debian-archive-keyring.gpg /usr/share/keyrings/debian-archive-$suite-stable.gpg; do
    if [ -f "$k" ]; then keyring=$k; break; fi
done

mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
apt_dir=$dest/apt
mkdir -p "$apt_dir/none" "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/state" "$apt_dir/debs"
: > "$apt_dir/state/status"
signed=""
[ -n "$keyring" ] && signed="[signed-by=$keyring] "
echo "deb ${signed}$mirror $suite main" > "$apt_dir/sources.list"
cat > "$apt_dir/apt.conf" <<CONF
Dir::Etc::SourceList "$apt_dir/sources.list";
Dir::Etc::SourceParts "$apt_dir/none";
Dir::Etc::Preferences "$apt_dir/none/preferences";
Dir::Etc::PreferencesParts "$apt_dir/none";
Dir::State "$apt_dir/state";
Dir::State::Lists "$apt_dir/lists";
Dir::State::status "$apt_dir/state/status";
Dir::Cache "$apt_dir/cache";
APT::Get::List-Cleanup "false";
Debug::NoLocking "true";
CONF
# as root, apt would drop to the _apt user, who cannot write into the build tree
[ "$(id -u)" = 0 ] && echo 'APT::Sandbox::User "root";' >> "$apt_dir/apt.conf"
export APT_CONFIG="$apt_dir/apt.conf"
apt-get -q -o Acquire::Languages=none update >&2
(cd "$apt_dir/debs" && apt-get -q download libonnxruntime-dev >&2)
deb=$(ls "$apt_dir"/debs/libonnxruntime-dev_*.deb | head -n 1)
dpkg -x "$deb" "$dest/root"
inc=$(dirname "$(find "$dest/root" -name onnxruntime_cxx_api.h | head -n 1)")
[ -f "$inc/onnxruntime_cxx_api.h" ] || { echo "onnxruntime_cxx_api.h not in $deb" >&2; exit 1; }
echo "$inc"
