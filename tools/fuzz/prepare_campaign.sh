#!/bin/sh
# prepare_campaign.sh DIR — everything a fuzzing campaign needs on a machine without clang,
# LLVM, flex, bison or cmocka, in a new directory DIR to carry there:
#   DIR/bin/fuzz_*       the libFuzzer harnesses, built here by clang with -DFP8C_FUZZ=ON
#   DIR/corpus/NAME/     a copy of each seed corpus (tests/fuzz/corpus), which the run grows
#   DIR/campaign.sh      the script that runs them (tools/fuzz/campaign.sh)
#   DIR/VERSION          the commit they were built from
# Then, there: DIR/campaign.sh DIR MINUTES.
#
# clang links the sanitizer and libFuzzer runtimes statically, and a fuzz build has no LLVM
# renderer and no GPU backend, so each binary needs only libc, libm, libstdc++ and libgcc_s:
# this script checks that with ldd and stops if anything else is linked. They keep their debug
# information (about 20 MiB for all six) so that a crash's stack trace names the lines.
# Environment: BUILD, the build directory (default build-fuzz, kept for later builds).
set -eu
dir=${1:?usage: prepare_campaign.sh DIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD:-$root/build-fuzz}
if [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
    echo "prepare_campaign.sh: $dir exists and is not empty; name a new directory" >&2
    exit 2
fi
command -v clang >/dev/null || { echo "prepare_campaign.sh: needs clang (with compiler-rt)" >&2; exit 2; }

CC=clang cmake -S "$root" -B "$build" -DFP8C_FUZZ=ON -DFP8C_TESTS=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$build.cmake.log" 2>&1 ||
    { cat "$build.cmake.log" >&2; exit 1; }
rm -f "$build.cmake.log"
cmake --build "$build" -j"${JOBS:-2}" >/dev/null

mkdir -p "$dir/bin" "$dir/corpus"
for bin in "$build"/tests/fuzz/fuzz_*; do
    [ -f "$bin" ] && [ -x "$bin" ] || continue
    name=$(basename "$bin")
    other=$(ldd "$bin" | awk '{print $1}' |
            grep -Ev '^(linux-vdso\.so|/lib64/ld-linux-x86-64\.so|ld-linux-x86-64\.so|lib(c|m|dl|rt|pthread|gcc_s|stdc\+\+)\.so)' || true)
    if [ -n "$other" ]; then
        echo "prepare_campaign.sh: $name links $other: it would not run where these are missing" >&2
        exit 1
    fi
    cp "$bin" "$dir/bin/"
    cp -r "$root/tests/fuzz/corpus/${name#fuzz_}" "$dir/corpus/"
done
cp "$root/tools/fuzz/campaign.sh" "$dir/"
(cd "$root" && git describe --always --dirty 2>/dev/null || echo unknown) > "$dir/VERSION"
echo "prepared $dir ($(du -sh "$dir" | cut -f1)): $(ls "$dir/bin" | tr '\n' ' ')"
echo "libraries: $(for b in "$dir"/bin/*; do ldd "$b"; done | awk '{print $1}' | sort -u | tr '\n' ' ')"
echo "run: $dir/campaign.sh $dir MINUTES"
