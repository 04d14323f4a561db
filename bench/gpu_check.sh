#!/usr/bin/env bash
# The GPU check: one run on a machine with a GPU, a few minutes end to end. It builds xlatrain with the CUDA
# extension, runs the CUDA collectives' tests on the GPU, then bench.gpu for GPT-2 small, a 1.1B Llama-style model and a
# Mixture of Experts (8 experts, top-2; the persistent compilation cache, a second start from it, one profiler trace
# each), and leaves every result in one flat folder of at most 9 small files:
#
#   summary.txt      one line per step: ok or failed, and its seconds
#   environment.txt  the GPU, Python, jax and the packages xlatrain needs, as found
#   build.log        the build (-Ccmake.define.XLATRAIN_CUDA=ON)
#   tests.log        tests/test_cuda_collectives.py and the NCCL test on the GPU
#   bench.log        both benchmarks' output
#   gpu.json, gpu_llama.json, gpu_moe.json   what bench.gpu measured (also written to bench/results/ unless --smoke)
#   trace.xplane.pb  GPT-2 small's profiler trace (left out above 16 MB)
#
#   bench/gpu_check.sh [--out DIR] [--wheels DIR] [--smoke]
#
# --out DIR     the folder (default: $OUT where set, else gpu_check/)
# --wheels DIR  wheels of the dependencies the machine's Python lacks (default: .whl/ when it exists), installed
#               with no index into a folder put on PYTHONPATH; make them where pip reaches a registry with
#               bench/gpu_wheels.sh DIR PYTHON_VERSION (the GPU machine's Python)
# --smoke       on a machine without a GPU: no build (the installed xlatrain runs; tests/test_collectives.py
#               compiles the CUDA extension with nvcc), the GPU tests report their skip, bench.gpu runs its tiny GPT
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-gpu_check}"
wheels=".whl"
smoke=0
while (($#)); do
  case "$1" in
    --out) out="$2"; shift ;;
    --wheels) wheels="$2"; shift ;;
    --smoke) smoke=1 ;;
    *) echo "usage: bench/gpu_check.sh [--out DIR] [--wheels DIR] [--smoke]" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
if [[ -n "$(ls -A "$out")" ]]; then
  echo "bench/gpu_check.sh: $out is not empty (an earlier check's results?): give a new or empty --out" >&2
  exit 2
fi
: > "$out/summary.txt"
export PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME LOG COMMAND...: runs it with its output appended to LOG, says ok or failed with its seconds
  local name="$1" log="$2" began
  shift 2
  began=$(date +%s)
  if "$@" >> "$log" 2>&1; then
    echo "$name: ok in $(($(date +%s) - began)) s" | tee -a "$out/summary.txt"
  else
    echo "$name: failed (exit $?) in $(($(date +%s) - began)) s; see $log" | tee -a "$out/summary.txt"
    failed=1
  fi
}

install_wheels() {
  if ! compgen -G "$wheels/*.whl" > /dev/null; then
    echo "no wheels in $wheels: the machine's Python has every dependency, or the imports below say which not"
    return 0
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/xlatrain-site \
    "$wheels"/*.whl
}

describe_environment() {
  date -u
  if command -v nvidia-smi > /dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
  python3 -V
  python3 - <<'EOF'
import importlib.metadata as metadata
import re
import tomllib

import jax

print("jax", jax.__version__, "devices:", jax.devices())
with open("pyproject.toml", "rb") as f:
    required = tomllib.load(f)["project"]["dependencies"]
for requirement in required:
    name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)
    try:
        print(f"{name} {metadata.version(name)} (xlatrain asks {requirement})")
    except metadata.PackageNotFoundError:
        print(f"{name}: MISSING (xlatrain asks {requirement}; bring it with --wheels)")
EOF
}

build() {
  if ((smoke)); then
    echo "--smoke: not built; the installed xlatrain runs"
    return 0
  fi
  python3 -m pip install --no-index --no-deps --no-build-isolation -e . -Ccmake.define.XLATRAIN_CUDA=ON
}

imports() {
  python3 -c "import xlatrain.cli; from xlatrain.custom_calls.backend import extension; \
print('xlatrain imports; CUDA extension', 'built' if extension('cuda') else 'not built')"
}

gpu_tests() {
  XLATRAIN_TEST_GPU=$((1 - smoke)) python3 -m pytest -q -n 0 -p no:cacheprovider -rs \
    tests/test_cuda_collectives.py tests/test_collectives.py::test_nccl_all_reduce_on_gpus
}

bench() {  # bench MODEL RESULT
  local work="/tmp/xlatrain-gpu-check-$1"
  rm -rf "$work"
  python3 -m bench.gpu --model "$1" --work "$work" --out "$out/$2" $( ((smoke)) && echo --smoke) || return
  if [[ "$1" == gpt2-small ]]; then
    local trace
    trace="$(find "$work" -name '*.xplane.pb' | head -n 1)"
    if [[ -n "$trace" && $(stat -c %s "$trace") -le 16777216 ]]; then
      cp "$trace" "$out/trace.xplane.pb"
    else
      echo "no trace of 16 MB or less to keep: ${trace:-none written}"
    fi
  fi
}

step "wheels" "$out/build.log" install_wheels
export PYTHONPATH="/tmp/xlatrain-site${PYTHONPATH:+:$PYTHONPATH}"
step "environment" "$out/environment.txt" describe_environment
step "build" "$out/build.log" build
step "imports" "$out/environment.txt" imports
step "gpu tests" "$out/tests.log" gpu_tests
step "bench gpt2-small" "$out/bench.log" bench gpt2-small gpu.json
if ((smoke)); then
  echo "bench llama-1b: skipped (--smoke: bench.gpu runs its one tiny GPT)" | tee -a "$out/summary.txt"
  echo "bench moe: skipped (--smoke: bench.gpu runs its one tiny GPT)" | tee -a "$out/summary.txt"
else
  step "bench llama-1b" "$out/bench.log" bench llama-1b gpu_llama.json
  step "bench moe" "$out/bench.log" bench moe gpu_moe.json
fi
exit "$failed"
