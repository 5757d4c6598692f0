#!/usr/bin/env bash
# Download the wheels calibrate/gpu-wheels.txt lists, for the GPU image's Python (3.12, x86-64
# Linux), into DIR (default out/gpu-wheels): run it on a machine with network before a lease and
# carry DIR to the GPU, then `WHEELS=DIR bash calibrate/gpu.sh`.
#
#   bash calibrate/fetch-gpu-wheels.sh [DIR] [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-out/gpu-wheels}
VERSION=${2:-3.12}
mkdir -p "$DIR"
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$VERSION" --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -r calibrate/gpu-wheels.txt -d "$DIR"
ls "$DIR"
