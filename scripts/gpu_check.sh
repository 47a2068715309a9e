#!/usr/bin/env bash
# One prepared check on a machine with a GPU, in at most ~8 minutes:
#   1. what is there (GPU, driver, nvcc, Vulkan loader and ICD, Python packages);
#   2. the native extension: built here with CMake when a compiler, CMake and pybind11 exist
#      (CUDA when nvcc is there, for the compute capability of the GPU found; Vulkan when its
#      headers and glslc are), else the one given by PYFAST_NATIVE (e.g. built on a CPU
#      machine and carried over, with libvulkan.so.1 beside it in LD_LIBRARY_PATH);
#   3. the op harness on every non-CPU device (cuda:N, vulkan:N) against the CPU reference
#      (tests/ops/test_devices.py);
#   4. the end-to-end device tests (tests/devices: hybrid fixtures vs transformers, batch
#      invariance, rollback, lossless n-gram / draft-mtp speculation, SmolLM2 perplexity vs CPU,
#      the server);
#   5. `pyfast bench` on the device: pp512 / tg128 on SmolLM2 (and BENCH_MODEL if given), with the
#      weight bytes read per second during decode as a fraction of the GPU's peak bandwidth
#      (PEAK_GBS, or a known figure for the GPU's name).
# Every step prints its elapsed time; a failing step does not stop the others. Exit status: the
# number of failed steps.
#
#   bash scripts/gpu_check.sh [DEVICE]      (bench device; default cuda:0 if listed, else vulkan:0)
#
# On a device machine without build tools: build the extension here (pip install . or CMake),
# copy the built _native*.so and this machine's libvulkan.so.1 into one folder that travels with
# the tree, and run with PYFAST_NATIVE=<that folder>/_native*.so LD_LIBRARY_PATH=<that folder>.
# BENCH_PP / BENCH_TG change the bench sizes (a dry run on lavapipe: BENCH_PP=8 BENCH_TG=4).
# SmolLM2 (98 MB) is read from $PYFAST_CACHE/models (default ~/.cache/pyfast): a machine that
# cannot download it needs the file copied there (the SmolLM2 tests fail without it).
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=${1:-}
T0=$(date +%s)
FAILED=0
log() { echo "[gpu_check +$(( $(date +%s) - T0 ))s] $*"; }
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  log "== $name"
  if timeout "$t" "$@"; then log "ok: $name"; else log "FAILED ($?): $name"; FAILED=$((FAILED + 1)); fi
}

log "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -1)
[ -n "$NVCC" ] && "$NVCC" --version | tail -1 || echo "(no nvcc: the CUDA backend cannot be built here)"
ldconfig -p 2>/dev/null | grep -m1 "libvulkan.so.1" || echo "(libvulkan.so.1 not in the linker cache; LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-})"
ls /usr/share/vulkan/icd.d /etc/vulkan/icd.d 2>/dev/null || echo "(no Vulkan ICD json found: the GPU's Vulkan driver is not installed)"
python3 -c "import numpy, tokenizers, jinja2; print('python deps ok')" || echo "(missing python packages)"
ls "${PYFAST_CACHE:-$HOME/.cache/pyfast}"/models/SmolLM2-135M-Instruct.Q4_1.gguf 2>/dev/null ||
  echo "(SmolLM2 is not in ${PYFAST_CACHE:-$HOME/.cache/pyfast}/models: its tests and bench need it)"

if [ -z "${PYFAST_NATIVE:-}" ]; then
  if command -v cmake >/dev/null && python3 -c "import pybind11" 2>/dev/null; then
    CUDA_ARGS="-DPYFAST_CUDA=AUTO"
    CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    if [ -n "$NVCC" ] && [ -n "$CAP" ]; then  # build for the GPU found (sm_$CAP) only
      CUDA_ARGS="-DPYFAST_CUDA=ON -DCMAKE_CUDA_COMPILER=$NVCC -DCMAKE_CUDA_ARCHITECTURES=$CAP"
    fi
    export CUDA_ARGS
    step "build (cmake: $CUDA_ARGS, Vulkan if found)" 300 bash -c '
      mkdir -p build && { cmake -S . -B build/gpu -DCMAKE_BUILD_TYPE=Release $CUDA_ARGS \
        -Dpybind11_DIR="$(python3 -c "import pybind11; print(pybind11.get_cmake_dir())")" &&
      cmake --build build/gpu -j"$(nproc)"; } > build/gpu_build.log 2>&1 || { tail -40 build/gpu_build.log; exit 1; }
      grep "pyfast:" build/gpu_build.log'
    export PYFAST_NATIVE=$(ls build/gpu/_native*.so 2>/dev/null | head -1)
  else
    log "no cmake / pybind11 here and PYFAST_NATIVE is not set: cannot build the extension"
    FAILED=$((FAILED + 1))
  fi
fi
log "extension: ${PYFAST_NATIVE:-installed package}"
python3 -m pyfast devices || FAILED=$((FAILED + 1))
if [ -z "$DEV" ]; then
  DEV=$(python3 -c "
import pyfast
d = [x['name'] for x in pyfast.devices() if x['kind'] != 'cpu']
print(next((n for n in d if n.startswith('cuda')), d[0] if d else 'vulkan:0'))")
fi
log "bench device: $DEV"
# The tests run on the GPUs: a Vulkan driver on the CPU (lavapipe) is left out here (CI runs it).
if [ -z "${PYFAST_TEST_DEVICES:-}" ]; then
  PYFAST_TEST_DEVICES=$(python3 -c "
import pyfast
print(','.join(x['name'] for x in pyfast.devices() if x['kind'] != 'cpu' and 'llvmpipe' not in x['description']))")
fi
export PYFAST_TEST_DEVICES
log "test devices: ${PYFAST_TEST_DEVICES:-(none)}"

if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: the bench alone
step "op harness on the devices" 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_devices.py
step "end to end on the devices" 240 python3 -m pytest -q -p no:cacheprovider tests/devices
fi

BENCH_PY=$(mktemp --suffix=.py /tmp/gpu_bench.XXXXXX)
cat > "$BENCH_PY" <<'EOF'
import os, subprocess, sys
from pyfast.bench import run_bench
from pyfast.hub import resolve_model
from pyfast.models import Model

path, dev = str(resolve_model(sys.argv[1])), sys.argv[2]
size = sum(i.nbytes for i in Model(path, mmap=True).weights.info.values())
peak = float(os.environ.get("PEAK_GBS", "0"))
if not peak:
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout
    except OSError:
        name = ""
    known = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "L4": 300, "A10": 600, "RTX 4090": 1008}
    peak = next((v for k, v in known.items() if k in name), 0)
pp, tg = int(os.environ.get("BENCH_PP", "512")), int(os.environ.get("BENCH_TG", "128"))
for r in run_bench(path, [pp], [tg], [4], reps=3, device=dev):
    line = f"{os.path.basename(path)} {r.test} on {dev}: {r.tps_median:.1f} t/s"
    if r.test.startswith("tg"):
        gbs = size * r.tps_median / 1e9
        line += f", weights read {gbs:.1f} GB/s" + (f" = {100 * gbs / peak:.1f}% of {peak:.0f} GB/s" if peak else "")
    print(line, flush=True)
EOF
step "bench SmolLM2" 90 python3 "$BENCH_PY" smollm2 "$DEV"
if [ -n "${BENCH_MODEL:-}" ]; then step "bench $BENCH_MODEL" 120 python3 "$BENCH_PY" "$BENCH_MODEL" "$DEV"; fi

log "done: $FAILED failed step(s)"
exit "$FAILED"
