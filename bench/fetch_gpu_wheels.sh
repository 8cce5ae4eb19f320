#!/usr/bin/env bash
# Download (on a machine with network) the wheels that bench/gpu_check.sh installs on a GPU
# machine that has none: kvikio-cu13 and what it needs beyond a CUDA torch/cupy image (libkvikio,
# rapids-logger, cuda-pathfinder, and libcufile in case the image lacks it), the packages
# gds_persist needs that a CUDA torch image lacks (awscrt, crc32c, blake3, blosc2 and its
# ndindex; for several Python versions) and hypothesis for the test suite. About 35 MB.
#
#   bash bench/fetch_gpu_wheels.sh DIR [PYTHON_VERSION ...]    (default: 3.10 3.11 3.12 3.13)
#   then on the GPU machine: bash bench/gpu_check.sh --wheels DIR
#
# kvikio-cu13 ships one cp311-abi3 wheel: the GPU machine needs Python >= 3.11 for it.
# KVIKIO_VERSION (default 26.10.0) picks the kvikio release; PYTHON the interpreter running pip.
set -euo pipefail
DIR="${1:?usage: fetch_gpu_wheels.sh DIR [PYTHON_VERSION ...]}"
shift
VERSIONS=("$@")
[ "${#VERSIONS[@]}" -gt 0 ] || VERSIONS=(3.10 3.11 3.12 3.13)
KV="${KVIKIO_VERSION:-26.10.0}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
get() {  # $1: python version, rest: requirements
    local v="$1"
    shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" -d "$DIR" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$@"
}
get 3.11 "kvikio-cu13==$KV" "libkvikio-cu13==$KV" "rapids-logger==0.3.*" cuda-pathfinder \
    "nvidia-cufile>=1.15"
get 3.11 sortedcontainers
for v in "${VERSIONS[@]}"; do
    get "$v" awscrt crc32c blake3 blosc2 ndindex hypothesis  # per-version wheels
done
ls -l "$DIR"
