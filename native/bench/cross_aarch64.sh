#!/usr/bin/env bash
# Cross-compile the standalone kernel test (test_quant_kernels.cpp + the native core) for aarch64
# Linux and, unless --build-only, run it under qemu-user on two CPU models:
#   -cpu max         (has the dotprod extension: the NEON kernels run with and without vdotq_s32)
#   -cpu cortex-a57  (plain ARMv8.0 NEON, no dotprod: only the vmull_s8 / vpadalq_s16 path)
# Every NEON result is compared bit for bit with the scalar path inside the test.
#
# The code is built for the baseline ISA (-march=armv8-a), as the library itself is: the dotprod
# kernels are compiled per function (target attribute) and chosen at run time from HWCAP_ASIMDDP.
#
# Needs: aarch64-linux-gnu-g++ and qemu-aarch64 (Debian: apt-get install g++-aarch64-linux-gnu
# qemu-user). Environment: OUT (build dir, default /tmp/pyfast_aarch64), JOBS (default 2),
# CXX_AARCH64 (compiler), QEMU (emulator), QEMU_CPUS (default "max cortex-a57"), ALL=1 (compile
# every core source, not just what the test links).
# Usage: native/bench/cross_aarch64.sh [--build-only] [test args...]   (e.g. "sweep": quick mode)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-/tmp/pyfast_aarch64}"
JOBS="${JOBS:-2}"
CXX="${CXX_AARCH64:-aarch64-linux-gnu-g++}"
QEMU="${QEMU:-qemu-aarch64}"
QEMU_CPUS="${QEMU_CPUS:-max cortex-a57}"
BUILD_ONLY=0
if [[ "${1:-}" == "--build-only" ]]; then BUILD_ONLY=1; shift; fi

command -v "$CXX" >/dev/null || { echo "cross_aarch64: $CXX not found" >&2; exit 77; }
mkdir -p "$OUT/obj"
# Same flags as CMakeLists.txt's pyfast_core (fp contraction off: the kernels' arithmetic is exact).
FLAGS=(-std=c++17 -O3 -march=armv8-a -fno-math-errno -ffp-contract=off -Wall -Wno-unused-function
       -I"$ROOT/native/include" -I"$ROOT/native" -pthread)

# What the kernel test links (matmul and matmul_id drivers, codecs, all mm_<isa>.cpp, ISA
# selection, thread pool). ALL=1 compiles every core source
# (a check that the whole native core builds for aarch64); the link set stays the same.
LINK=(native/core/dtype.cpp native/core/threadpool.cpp native/cpu/cpu_features.cpp native/cpu/fp16.cpp
      native/cpu/kernels/matmul.cpp native/cpu/kernels/moe.cpp native/bench/test_quant_kernels.cpp)
for f in "$ROOT"/native/cpu/quant/*.cpp; do LINK+=("${f#$ROOT/}"); done
EXTRA=()
if [[ "${ALL:-0}" == 1 ]]; then
  EXTRA=()
  for d in native/core native/cpu native/cpu/kernels; do
    for f in "$ROOT/$d"/*.cpp; do
      rel="${f#$ROOT/}"
      [[ " ${LINK[*]} " == *" $rel "* ]] || EXTRA+=("$rel")
    done
  done
fi
SRCS=()
for r in "${LINK[@]}" "${EXTRA[@]}"; do SRCS+=("$ROOT/$r"); done

# Rebuild an object when its source or any header under native/ is newer (crude but safe).
newest_header=$(find "$ROOT/native" -name '*.h' -o -name '*.def' | xargs ls -t | head -1)
todo=()
objs=()
for r in "${LINK[@]}"; do objs+=("$OUT/obj/${r//\//_}.o"); done
for s in "${SRCS[@]}"; do
  rel="${s#$ROOT/}"
  o="$OUT/obj/${rel//\//_}.o"
  if [[ ! -f "$o" || "$s" -nt "$o" || "$newest_header" -nt "$o" || "$0" -nt "$o" ]]; then todo+=("$s"); fi
done
export CXX OUT ROOT
export FLAGS_STR="${FLAGS[*]}"
if ((${#todo[@]})); then
  printf '%s\n' "${todo[@]}" | xargs -P "$JOBS" -I{} bash -c '
    s="{}"; rel="${s#$ROOT/}"; o="$OUT/obj/${rel//\//_}.o"
    extra=""
    # GCC 12 (aarch64) ICEs in the loop vectorizer on the test driver (vect_transform_reduction).
    [[ "$rel" == native/bench/* ]] && extra="-fno-tree-loop-vectorize"
    echo "  CXX $rel"; $CXX $FLAGS_STR $extra -c "$s" -o "$o"'
fi
"$CXX" -static -pthread "${objs[@]}" -o "$OUT/test_quant_kernels"
echo "built $OUT/test_quant_kernels"
((BUILD_ONLY)) && exit 0

command -v "$QEMU" >/dev/null || { echo "cross_aarch64: $QEMU not found" >&2; exit 77; }
rc=0
for cpu in $QEMU_CPUS; do
  echo "=== qemu-aarch64 -cpu $cpu"
  "$QEMU" -cpu "$cpu" "$OUT/test_quant_kernels" "$@" || rc=1
done
exit $rc
