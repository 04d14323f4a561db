#!/usr/bin/env bash
# Wheels of xlatrain's dependencies that a GPU machine's Python lacks, for bench/gpu_check.sh --wheels DIR, made
# where pip reaches a registry (the GPU machine may reach none), at the versions installed here (what CI tests).
#
#   bench/gpu_wheels.sh DIR [PYTHON_VERSION] [PACKAGE...]
#
# PYTHON_VERSION: the GPU machine's, e.g. 3.12 (the default). PACKAGE...: what it lacks; by default what the
# lent H200 machines' image lacks (grain and what grain needs beyond it, omegaconf, pydantic and its parts,
# tensorboardX). gpu_check.sh's environment.txt lists, per dependency, the version found or MISSING.
set -euo pipefail
dir="${1:?usage: bench/gpu_wheels.sh DIR [PYTHON_VERSION] [PACKAGE...]}"
python_version="${2:-3.12}"
shift $(($# < 2 ? $# : 2))
packages=("$@")
if ((${#packages[@]} == 0)); then
  packages=(grain array-record portpicker omegaconf pydantic pydantic-core annotated-types typing-inspection
            tensorboardX)
fi
pinned=()
for package in "${packages[@]}"; do
  version="$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$package")" || {
    echo "bench/gpu_wheels.sh: $package is not installed here: install it (pip install -e .) to take its version" >&2
    exit 2
  }
  pinned+=("$package==$version")
done
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  "${platforms[@]}" -d "$dir" "${pinned[@]}"
du -sh "$dir"
ls "$dir"
