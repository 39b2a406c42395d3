#!/usr/bin/env bash
# Builds an arm64 (aarch64) root in which a Kiln runtime agent runs under qemu-user on an
# x86-64 host: Debian's arm64 Python 3.11 unpacked from its packages (no chroot, no
# debootstrap, no binfmt registration, nothing installed system-wide), and the agent's
# Python dependencies as aarch64 wheels in <root>/opt/kiln/site.
#
#   deploy/arm64/make-root.sh [ROOT]        ROOT defaults to $KILN_ARM64_ROOT, else
#                                           ~/.cache/kiln/arm64-root
#
# Then run aarch64 Python with:
#   qemu-aarch64-static -L ROOT ROOT/usr/bin/python3.11
# with PYTHONPATH=ROOT/opt/kiln/site:<the checkout>  (deploy/arm64/python does exactly this).
#
# Reproducible: the packages come from the host's own apt sources (the same suite and
# snapshot as the host's Python), resolved with a private apt state under ROOT/.apt (the
# host's dpkg database and architectures are left alone), and the wheels are pinned by
# deploy/arm64/requirements.txt. Needs: apt-get, dpkg-deb, qemu-user-static (for the check
# at the end) and a pip that can download for another platform.
set -euo pipefail

ROOT=${1:-${KILN_ARM64_ROOT:-$HOME/.cache/kiln/arm64-root}}
HERE=$(cd "$(dirname "$0")" && pwd)
PIP=${PIP:-pip}
QEMU=${QEMU:-qemu-aarch64-static}
# The Debian packages of an aarch64 Python 3.11 (and what it links): apt resolves the rest.
PACKAGES=(python3.11 libpython3.11-stdlib python3.11-minimal libffi8 libssl3 zlib1g
          libexpat1 libbz2-1.0 liblzma5 libsqlite3-0 libstdc++6 libgcc-s1 libc6)

started=$(date +%s)
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
APT="$ROOT/.apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs"
: > "$APT/status"
opts=(-o "APT::Architecture=arm64" -o "APT::Architectures::=arm64"
      -o "Dir::State=$APT" -o "Dir::State::lists=$APT/lists" -o "Dir::State::status=$APT/status"
      -o "Dir::Cache=$APT/cache" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")

echo "== apt index for arm64 (private state in $APT)"
apt-get "${opts[@]}" -qq update

echo "== resolving and downloading ${#PACKAGES[@]} packages and their dependencies"
mapfile -t debs < <(apt-cache "${opts[@]}" depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances \
    "${PACKAGES[@]}" 2>/dev/null | grep -E '^[a-z0-9]' | sed 's/:arm64$//' | sort -u)
# Virtual packages and things a Python interpreter never loads are left out.
skip='^(debconf|debconf-2.0|perl-base|dpkg|tar|coreutils|base-files|bash|dash|install-info|libc-bin|mime-support|media-types|tzdata|readline-common|libpam.*|util-linux|gcc-12-base|debianutils)$'
wanted=()
for name in "${debs[@]}"; do
  [[ $name =~ $skip ]] || wanted+=("$name")
done
(cd "$APT/debs" && apt-get "${opts[@]}" -qq download "${wanted[@]/%/:arm64}")

echo "== unpacking $(ls "$APT/debs" | wc -l) packages into $ROOT"
for deb in "$APT/debs"/*.deb; do
  dpkg-deb -x "$deb" "$ROOT"
done
# Debian's usrmerge layout: the loader is looked up as /lib/ld-linux-aarch64.so.1.
for dir in lib bin sbin; do
  if [ -d "$ROOT/$dir" ] && [ ! -L "$ROOT/$dir" ] && [ -d "$ROOT/usr/$dir" ]; then
    cp -a "$ROOT/$dir/." "$ROOT/usr/$dir/" && rm -rf "${ROOT:?}/$dir"
  fi
  [ -e "$ROOT/$dir" ] || ln -s "usr/$dir" "$ROOT/$dir"
done

echo "== aarch64 wheels into $ROOT/opt/kiln/site"
rm -rf "$ROOT/opt/kiln/site"
"$PIP" install --quiet --disable-pip-version-check --no-compile --target "$ROOT/opt/kiln/site" \
    --platform manylinux2014_aarch64 --platform manylinux_2_28_aarch64 \
    --platform manylinux_2_17_aarch64 --platform linux_aarch64 \
    --python-version 3.11 --implementation cp --abi cp311 --only-binary=:all: \
    -r "$HERE/requirements.txt"

echo "== check: aarch64 Python imports numpy and iree.runtime under $QEMU"
QEMU_LD_PREFIX="$ROOT" PYTHONPATH="$ROOT/opt/kiln/site" PYTHONNOUSERSITE=1 \
    "$QEMU" -L "$ROOT" "$ROOT/usr/bin/python3.11" -c \
    'import platform, numpy, iree.runtime; print(platform.machine(), "python", platform.python_version(), "numpy", numpy.__version__)'
echo "arm64 root ready in $ROOT ($(( $(date +%s) - started )) s); export KILN_ARM64_ROOT=$ROOT"
