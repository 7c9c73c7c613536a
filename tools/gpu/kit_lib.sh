# shellcheck shell=bash
# kit_lib.sh — what tune_gpu.sh and memory_budget.sh share; sourced from the repository root,
# not run. A kit is a folder made here, without a GPU, and carried to a GPU machine: an fp8c
# without LLVM, the runtime libraries it links into binaries, and KIT/fp8c-cache, the NVRTC
# modules of the builds the GPU machine will ask for (a hit there when its NVRTC is the same
# version; a miss is compiled there, on GPU time). The configurations:
#
#   d12:-On   GPT-2 d12 (124M), batch 32 x 1024 at level n
#   d48:-On   GPT-2 d48 (1.5B: 48 layers, width 1600, 25 heads), batch 8 x 1024 at level n
#
# KIT/fp8c-cache is what grows with configurations: about 1 MiB a module (one per build whose
# kernel program differs; 80 modules, 86 MiB, for the four configurations and the memory
# search), and a device run carries 64 MiB in all. The kit carries it packed (kit_pack_cache).

KIT_MODEL=models/gpt2.model

# The build flags of a size (d12, d48) at a batch (default: the size's own), without a level.
kit_size_flags() {
    case $1 in
    d12) echo "--batch ${2:-32} --seq 1024" ;;
    d48) echo "-D layers=48 -D dim=1600 -D heads=25 --batch ${2:-8} --seq 1024" ;;
    *) return 1 ;;
    esac
}

# NAME (d12:-O1) -> CFG_SIZE (d12), CFG_LEVEL (-O1), CFG_DIR (d12_O1: a folder name with no
# colon), CFG_FLAGS (level and size flags); false after a line on stderr when it is not one.
kit_config() {
    CFG_SIZE=${1%%:*}
    CFG_LEVEL=${1#*:}
    CFG_DIR=${CFG_SIZE}_${CFG_LEVEL#-}
    case $CFG_LEVEL in -O[0-3]) ;; *) echo "kit: '$1' is not SIZE:-On (d12:-O1)" >&2; return 1 ;; esac
    CFG_FLAGS="$CFG_LEVEL $(kit_size_flags "$CFG_SIZE")" ||
        { echo "kit: '$1': no size '$CFG_SIZE' (d12, d48)" >&2; return 1; }
}

# The value of VAR_<dir>, else VAR_<size>, else VAR, else the default given: a per-configuration
# knob (BUDGET_d48_O3, BUDGET_d48, BUDGET).
kit_knob() {
    local var=$1 dflt=$2 v
    for v in "${var}_${CFG_DIR}" "${var}_${CFG_SIZE}" "$var"; do
        if [ -n "${!v:-}" ]; then echo "${!v}"; return; fi
    done
    echo "$dflt"
}

# Builds fp8c without LLVM (the GPU machine has none: an fp8c linked to libLLVM would not start
# there) and the runtime libraries, into KIT; BUILD is the cmake folder.
kit_build_fp8c() {
    local kit=$1 build=$2 lib
    cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DLLVM_CONFIG=/nonexistent/llvm-config >/dev/null
    make -C "$build" -j"${JOBS:-2}" fp8c fp8c_train_main fp8c_rt fp8c_cuda_rt fp8c_kernels fp8c_ir >/dev/null
    if ldd "$build/fp8c" | grep -qi llvm; then
        echo "kit: $build/fp8c still links LLVM" >&2
        return 1
    fi
    cp "$build/fp8c" "$kit/"
    for lib in libfp8c_train_main.a libfp8c_cuda_rt.a libfp8c_rt.a libfp8c_kernels.a libfp8c_ir.a; do
        cp "$build/$lib" "$kit/"
    done
    strip --strip-debug "$kit"/fp8c "$kit"/*.a
    echo "git commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with local changes)')" > "$kit/BUILD_INFO"
}

# Compiles the GPU modules of one build (FLAGS, plus --choice C when C is given) into
# $FP8C_CACHE_DIR; one line: the choice, the kernel count or the error, the seconds.
kit_compile() {
    local flags=$1 choice=${2:-} tmp t0 what
    tmp=$(mktemp -d)
    t0=$(date +%s)
    what=$("$KIT/fp8c" build $KIT_MODEL $flags ${choice:+--choice "$choice"} -o "$tmp/bin" 2>&1 |
           grep -E "GPU kernels|error" | head -2 | tr '\n' ' ')
    echo "  ${choice:-defaults}: ${what:-(no GPU kernels line)}$(( $(date +%s) - t0 )) s"
    rm -rf "$tmp"
}

# What the binaries leave in the cache that the GPU machine does not need: PTX (for reading)
# and whole binaries (they are linked again there, against its libraries).
kit_trim_cache() {
    rm -f "$FP8C_CACHE_DIR"/*.ptx "$FP8C_CACHE_DIR"/bin-*
}

# The cache travels as KIT/fp8c-cache.tar.xz: the modules of one model share most of their
# bytes, and xz, whose window spans files, makes those 86 MiB 1.1 MiB (gzip, with its 32 KiB
# window, 8 MiB of 32). KIT is packed, the folder removed.
kit_pack_cache() {
    [ -d "$1/fp8c-cache" ] || return 0
    tar -C "$1" -cJf "$1/fp8c-cache.tar.xz.tmp" fp8c-cache &&
        mv "$1/fp8c-cache.tar.xz.tmp" "$1/fp8c-cache.tar.xz" && rm -rf "$1/fp8c-cache"
}

# KIT's packed cache into DIR/fp8c-cache (nothing when there is none); python's tarfile where
# tar has no xz.
kit_unpack_cache() {
    [ -f "$1/fp8c-cache.tar.xz" ] || return 0
    tar -C "$2" -xJf "$1/fp8c-cache.tar.xz" 2>/dev/null ||
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$1/fp8c-cache.tar.xz" "$2"
}

# On the GPU machine: the environment fp8c needs from KIT, the cache unpacked (into KIT, or a
# temp folder when KIT cannot be written), and the checks that it can work here; false after
# saying what is missing (through say, which the caller defines).
kit_run_env() {
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
    local into=$KIT
    [ -w "$KIT" ] || into=$(mktemp -d)
    kit_unpack_cache "$KIT" "$into" || { say "cannot unpack $KIT/fp8c-cache.tar.xz into $into"; return 1; }
    export FP8C_CACHE_DIR=$into/fp8c-cache
    export FP8C_LIBDIR=$KIT
    FP8C=$KIT/fp8c
    say "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
    command -v cc >/dev/null || { say "no C compiler (cc) on this machine: fp8c cannot link binaries here"; return 1; }
    [ -f "${FP8C_CUDA_INCLUDE:-/usr/local/cuda/include}/cuda_fp8.h" ] ||
        { say "no CUDA headers in ${FP8C_CUDA_INCLUDE:-/usr/local/cuda/include} (set FP8C_CUDA_INCLUDE): NVRTC needs them"; return 1; }
    "$FP8C" --version >/dev/null 2>&1 || { say "fp8c does not start here: $("$FP8C" --version 2>&1 | head -2)"; return 1; }
}

# Any text for the binaries to train on (they read bytes): 40 MB, enough for every run here.
kit_data() {
    [ -s "$1" ] || head -c 30000000 /dev/urandom | base64 > "$1"
}

# Runs a training binary: BIN LOG STEPS; its output to LOG's .out.
kit_train() {
    rm -f "$2"
    "$1" --data "$KIT_DATA" --steps "$3" --log "$2" --eval-every 0 --eval-batches 1 --device cuda --seed 1 \
        > "${2%.jsonl}.out" 2>&1
}

# FIELD's median over a run's steps after the first 5 (ms, tokens_per_s): the first steps load
# modules and warm the clocks.
kit_median() {
    python3 - "$1" "$2" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
v = [r[sys.argv[2]] for r in rows if isinstance(r.get(sys.argv[2]), (int, float))][5:]
print(f"{statistics.median(v):.2f}" if v else "nan")
EOF
}
