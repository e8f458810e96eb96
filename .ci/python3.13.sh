#!/usr/bin/env bash
# Print the path of a CPython 3.13 interpreter, building it if need be.
#
# The newest jax needs Python >= 3.12 and this machine's own Python is 3.11.
# CPython is built from Debian's source package, which the machine's apt
# archive serves (no other download), checked against the sha256 of the
# package's .dsc, and installed under a cache folder that later runs reuse:
# ${LOSS_SCALE_CI_CACHE:-$HOME/.cache/loss_scale-ci}/python-3.13.5.
# A build takes about 5 minutes on 2 cores; its log goes to build.log there.
set -euo pipefail
version=3.13.5
sha256=93e583f243454e6e9e4588ca2c2662206ad961659863277afcdb96801647d640
pool=http://deb.debian.org/debian/pool/main/p/python3.13
cache=${LOSS_SCALE_CI_CACHE:-$HOME/.cache/loss_scale-ci}
prefix=$cache/python-$version
python=$prefix/bin/python3.13

# A usable build has the modules pip, venv and the test suite need.
if [ -x "$python" ] && "$python" -c "import ssl, sqlite3, lzma, bz2, ctypes, zlib, venv" 2>/dev/null; then
  echo "$python"
  exit 0
fi

mkdir -p "$cache"
work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
(
  cd "$work"
  curl -fsS -o python.tar.xz "$pool/python3.13_$version.orig.tar.xz"
  echo "$sha256  python.tar.xz" | sha256sum --check --quiet
  tar -xJf python.tar.xz
  cd "Python-$version"
  ./configure --prefix="$prefix" --with-ensurepip=install
  make -j"$(nproc)"
  make install
) >"$cache/build.log" 2>&1 || {
  echo "building CPython $version failed; the end of $cache/build.log:" >&2
  tail -30 "$cache/build.log" >&2
  exit 1
}
"$python" -c "import ssl, sqlite3, lzma, bz2, ctypes, zlib, venv" >&2
echo "$python"
