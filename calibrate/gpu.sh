#!/usr/bin/env bash
# Unattended GPU calibration and decode benchmark: one NVIDIA GPU, no network. The eager
# calibration took Huginn 99-123 s, Ouro 68-85 s on an H200 (QUICK=1: 47 s and 49 s),
# docs/results/2026-11-30-h200-eager.md.
#
#   bash calibrate/gpu.sh                  # cuda, bf16, real Huginn-3.5B and Ouro-2.6B sizes
#   DEVICE=cpu DTYPE=fp32 QUICK=1 SIZES=tiny bash calibrate/gpu.sh   # the same script, tiny, CPU
#   FAMILIES=ouro bash calibrate/gpu.sh    # one family (each family's run can have its own timeout)
#   MODES="graphs" BENCH=0 bash calibrate/gpu.sh   # calibrate in graphs mode only, no benchmark
#   MACHINE_FROM=PROFILE bash calibrate/gpu.sh  # reuse a profile's machine measurements
#   REF_HUGINN=DIR REF_OURO=DIR bash calibrate/gpu.sh  # with the reference implementations'
#                                                      # generate as the benchmark's baseline
#
# For each family and each mode in MODES (default on CUDA: eager and graphs; on a CPU: eager),
# random-weight models at the real sizes (timing needs no trained weights) are fitted with the
# small and mid variants; the base variant (about 230 MB) is held out. Writes
# OUT/gpu-FAMILY-DTYPE.json (eager) or OUT/gpu-FAMILY-DTYPE-graphs.json, each with its validation
# plot (.png) and report (.validation.json); with both modes, OUT/gpu-FAMILY-DTYPE-modes.json
# fits them together and validates each mode's fit on the other (`costmodel join-modes`,
# docs/calibration.md). The held-out DtV and WFD runs sweep the forced acceptance over
# ACCEPTANCES (default 0.6,0.75,0.9) at the model's default draft depth. Then (BENCH=1) bench/decode_speed.py times AR, DtV
# and WFD at the real size in BENCH_MODES (default: graphs on CUDA), context BENCH_CONTEXT
# (1,024) and BENCH_TOKENS new tokens (256), forced acceptance 0.9, draft depth 4 (Huginn) or 1
# (Ouro), and writes OUT/bench-FAMILY-DTYPE.md and .json. REF_HUGINN / REF_OURO: folders of the
# public modeling code (bench/reference_parity.py says which files); their generate needs the
# transformers they were written for, carried as wheels on PYTHONPATH: Huginn's
# raven_modeling_minimal.py runs under 4.53.3 (tokenizers 0.21, huggingface-hub < 1), ouro_rl's
# modeling_ouro.py under 4.57.6 (tokenizers 0.22, huggingface-hub < 1), so run each family
# with its own PYTHONPATH (FAMILIES=huginn, then FAMILIES=ouro).
#
# A step that fails (a calibration, a join, the benchmark) is reported and the script goes on
# with the next one that does not need it: on a lent machine one failure must not cost the rest
# of the lease. It exits 1 at the end, naming the failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
OUT=${OUT:-data/profiles}
SIZES=${SIZES:-real}
# the interpreter that has torch and this project's dependencies (on this project's lent H200
# machines: PYTHON=/opt/torch/.venv/bin/python3, with pydantic carried as wheels and the
# repository on PYTHONPATH; call it directly: a symlink to a venv's python loses the venv)
PY=${PYTHON:-python}
FAILED=()
step() {  # step NAME COMMAND...: run it; on failure, say so and remember it
  local name=$1 rc=0; shift
  "$@" || rc=$?
  [ "$rc" -eq 0 ] && return 0
  echo "FAILED: $name (exit $rc)" >&2
  FAILED+=("$name")
  return 1
}
QUICK_FLAG=$([ "${QUICK:-0}" = "1" ] && echo --quick || true)
mkdir -p "$OUT"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
if [ "${DEVICE%%:*}" = cuda ]; then
  MODES=${MODES:-eager graphs}; BENCH_MODES=${BENCH_MODES:-graphs}
else
  MODES=${MODES:-eager}; BENCH_MODES=${BENCH_MODES:-eager}
fi
benchmark() {  # benchmark FAMILY MODEL DRAFT_DEPTH [--reference-FAMILY DIR]
  "$PY" bench/decode_speed.py schedules --models "$2" --device "$DEVICE" \
    --dtype "$DTYPE" --modes $BENCH_MODES --context "${BENCH_CONTEXT:-1024}" \
    --new-tokens "${BENCH_TOKENS:-256}" --repeats "${BENCH_REPEATS:-2}" --prompts 1 \
    --draft-depth "$3" --block-lengths 2 4 8 --acceptance 0.9 "${@:4}" \
    --out "$OUT/bench-$1-$DTYPE.json" | tee "$OUT/bench-$1-$DTYPE.md"
}
for family in ${FAMILIES:-huginn ouro}; do
  started=$SECONDS
  if [ "$SIZES" = "real" ]; then
    big=$([ "$family" = huginn ] && echo huginn-3.5b || echo ouro-2.6b)
    fit="$family-small:random,$family-mid:random,$big:random"
    holdout="$family-base:random"
    bench_model="$big:random"
  else
    fit="$family-tiny:random"
    holdout="$family-small:random"
    bench_model="$family-tiny:random"
  fi
  calibrated=" "
  for mode in $MODES; do
    name="gpu-$family-$DTYPE$([ "$mode" = graphs ] && echo -graphs || true)"
    # --force: an unattended run keeps its profile, flagged if the machine was busy (a GPU's
    # never is; a CPU rehearsal beside other work can be), rather than lose the run
    if ! step "$family $mode calibration" "$PY" -m costmodel calibrate --model "$family" \
        --device "$DEVICE" --dtype "$DTYPE" \
        --mode "$mode" $QUICK_FLAG --fit-models "$fit" --holdout-model "$holdout" --force \
        ${MACHINE_FROM:+--machine-from "$MACHINE_FROM"} \
        --acceptances "${ACCEPTANCES:-0.6,0.75,0.9}" \
        --out "$OUT/$name.json" --json > "$OUT/$name.validation.json"; then
      continue
    fi
    # the machine is measured once per run: later calibrations reuse the first one's peaks
    MACHINE_FROM=${MACHINE_FROM:-$OUT/$name.json}
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1], 'median', round(r['median_rel_error'],3), 'max', round(r['max_rel_error'],3))" "$OUT/$name.validation.json"
    echo "$family $mode calibrated in $((SECONDS - started)) s"
    calibrated+="$mode "
  done
  if [[ "$calibrated" == *" eager "* && "$calibrated" == *" graphs "* ]]; then
    # both modes in one fit (the device's coefficients shared), validated across the modes
    joint="gpu-$family-$DTYPE-modes"
    step "$family join-modes" "$PY" -m costmodel join-modes "$OUT/gpu-$family-$DTYPE.json" \
      "$OUT/gpu-$family-$DTYPE-graphs.json" --out "$OUT/$joint.json" \
      && step "$family joint validation" "$PY" -m costmodel validate \
        --profile "$OUT/$joint.json" --json > "$OUT/$joint.validation.json"
  fi
  if [ "${BENCH:-1}" = "1" ]; then
    draft=$([ "$family" = huginn ] && echo 4 || echo 1)
    ref_var="REF_${family^^}"
    ref_flag=${!ref_var:+--reference-$family ${!ref_var}}
    step "$family benchmark" benchmark "$family" "$bench_model" "$draft" $ref_flag
    echo "$family benchmarked; $((SECONDS - started)) s in all"
  fi
done
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'failed steps: %s\n' "$(IFS=';'; echo "${FAILED[*]}")" >&2
  exit 1
fi
