#!/usr/bin/env bash
# Unattended GPU calibration: one NVIDIA GPU, no network. On an H200: Huginn 99-123 s, Ouro
# 68-85 s (QUICK=1: 47 s and 49 s), docs/results/2026-11-30-h200-eager.md.
#
#   bash calibrate/gpu.sh                  # cuda, bf16, real Huginn-3.5B and Ouro-2.6B sizes
#   DEVICE=cpu DTYPE=fp32 QUICK=1 SIZES=tiny bash calibrate/gpu.sh   # the same script, tiny, CPU
#   FAMILIES=ouro bash calibrate/gpu.sh    # one family (each family's run can have its own timeout)
#
# Random-weight models at the real sizes (timing needs no trained weights) are fitted with the
# small and mid variants; the base variant (about 230 MB) is held out. The decoder has no
# CUDA-graph path yet, so the profile is for eager launches. Writes OUT/gpu-FAMILY-DTYPE.json,
# its validation plot (.png) and its validation report (.validation.json).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
OUT=${OUT:-data/profiles}
SIZES=${SIZES:-real}
# the interpreter that has torch and this project's dependencies (on this project's lent H200
# machines: PYTHON=/opt/torch/.venv/bin/python3, with pydantic carried as wheels and the
# repository on PYTHONPATH; call it directly: a symlink to a venv's python loses the venv)
PY=${PYTHON:-python}
QUICK_FLAG=$([ "${QUICK:-0}" = "1" ] && echo --quick || true)
mkdir -p "$OUT"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
for family in ${FAMILIES:-huginn ouro}; do
  started=$SECONDS
  if [ "$SIZES" = "real" ]; then
    big=$([ "$family" = huginn ] && echo huginn-3.5b || echo ouro-2.6b)
    fit="$family-small:random,$family-mid:random,$big:random"
    holdout="$family-base:random"
  else
    fit="$family-tiny:random"
    holdout="$family-small:random"
  fi
  "$PY" -m costmodel calibrate --model "$family" --device "$DEVICE" --dtype "$DTYPE" \
    $QUICK_FLAG --fit-models "$fit" --holdout-model "$holdout" \
    --out "$OUT/gpu-$family-$DTYPE.json" --json > "$OUT/gpu-$family-$DTYPE.validation.json"
  "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1], 'median', round(r['median_rel_error'],3), 'max', round(r['max_rel_error'],3))" "$OUT/gpu-$family-$DTYPE.validation.json"
  echo "$family calibrated in $((SECONDS - started)) s"
done
