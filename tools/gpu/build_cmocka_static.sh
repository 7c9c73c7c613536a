#!/usr/bin/env bash
# The GPU tests link cmocka statically (the GPU machine has no cmocka), but Debian's
# libcmocka-dev ships only the shared library. This builds libcmocka.a from Debian's own
# source package (the same version as the installed header) and installs it in PREFIX/lib,
# where CMake's find_library finds it before the shared one.
# usage: tools/gpu/build_cmocka_static.sh [PREFIX]        (default /usr/local; needs root)
set -euo pipefail
PREFIX=${1:-/usr/local}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/parts"
cat > "$WORK/parts/src.sources" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $(. /etc/os-release && echo "$VERSION_CODENAME")
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
opts="-oDir::Etc::SourceList=/dev/null -oDir::Etc::SourceParts=$WORK/parts -oDir::State::Lists=$WORK/lists"
apt-get $opts update >/dev/null
(cd "$WORK" && apt-get $opts source --download-only cmocka >/dev/null)
# the orig tarball, not its detached signature (cmocka_*.orig.tar.xz.asc)
tar xf "$(ls "$WORK"/cmocka_*.orig.tar.* | grep -v '\.asc$' | head -1)" -C "$WORK"
src=$(find "$WORK" -maxdepth 1 -type d -name 'cmocka-*' | head -1)
cmake -S "$src" -B "$WORK/build" -DWITH_STATIC_LIB=ON -DWITH_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_POSITION_INDEPENDENT_CODE=ON >/dev/null
make -C "$WORK/build" -j2 >/dev/null
install -m 644 "$WORK/build/src/libcmocka-static.a" "$PREFIX/lib/libcmocka.a"
echo "installed $PREFIX/lib/libcmocka.a"
