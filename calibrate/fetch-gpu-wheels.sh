#!/usr/bin/env bash
# Download the wheels the GPU image lacks, for its Python (3.12, x86-64 Linux), into DIR (default
# out/gpu-wheels): calibrate/gpu-wheels.txt (what the project needs) into DIR, and for the
# reference baseline calibrate/gpu-wheels-FAMILY.txt (each reference's transformers) into
# DIR/FAMILY. Run it on a machine with network before a lease and carry DIR to the GPU, then
# `WHEELS=DIR REF_WHEELS=DIR bash calibrate/gpu.sh`.
#
#   bash calibrate/fetch-gpu-wheels.sh [DIR] [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-out/gpu-wheels}
VERSION=${2:-3.12}
download() {  # download REQUIREMENTS FOLDER
  mkdir -p "$2"
  "${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$VERSION" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -r "$1" -d "$2"
}
download calibrate/gpu-wheels.txt "$DIR"
for family in huginn ouro; do
  download "calibrate/gpu-wheels-$family.txt" "$DIR/$family"
done
du -sh "$DIR" "$DIR"/*/
