#!/usr/bin/env bash
# Unattended GPU campaign: smoke check, calibration in eager and graphs modes, the decode bench
# and the batch bench, on one NVIDIA GPU without network, from a checkout that is not installed.
#
#   bash calibrate/gpu.sh                  # cuda, bf16, real Huginn-3.5B and Ouro-2.6B sizes
#   DEVICE=cpu DTYPE=fp32 QUICK=1 SIZES=tiny bash calibrate/gpu.sh   # the same script, tiny, CPU
#   SIZES=smallest ...   # tiny, the tiny model held out too: every step, its figures meaningless
#   FAMILIES=ouro bash calibrate/gpu.sh    # one family
#   MODES="graphs" BENCH=0 bash calibrate/gpu.sh   # calibrate in graphs mode only, no benchmark
#   MACHINE_FROM=PROFILE bash calibrate/gpu.sh  # reuse a profile's machine measurements
#   WHEELS=DIR bash calibrate/gpu.sh       # Python packages the machine lacks, as wheels
#   REF_HUGINN=DIR REF_OURO=DIR REF_WHEELS=DIR bash calibrate/gpu.sh  # the reference
#        implementations' generate as the benchmark's baseline, each family with its transformers
#
# Everything is written under RESULTS (default out/gpu-run) and packed at the end, whatever
# failed, into one archive, ARCHIVE (default RESULTS.tar.gz): a lent machine hands back a few
# files. The repository root goes on PYTHONPATH and the interpreter is PYTHON (default python3):
# nothing needs the project installed. WHEELS: a folder of wheels (calibrate/gpu-wheels.txt
# lists those the GPU image lacks; calibrate/fetch-gpu-wheels.sh downloads them), unpacked into
# a folder put first on PYTHONPATH.
#
# Steps, each under `timeout`: STEP_SECONDS at most, and never past BUDGET_SECONDS from the
# start (a step that would start after it is skipped and named; the archive is still made).
# Stage by stage, each for every family in FAMILIES, so a run cut short keeps the first stages:
# 1. SMOKE=1 (default): calibrate/gpu_smoke.py: versions, the attention kernels, the modes
#    against a full forward (SMOKE=0 leaves it out: a rerun on the same machine).
# 2. BENCH=1: bench/decode_speed.py times AR, DtV and WFD at the real size in BENCH_MODES
#    (default on CUDA: eager and graphs), context BENCH_CONTEXT (1,024), BENCH_TOKENS new
#    tokens (256), forced acceptance 0.9, draft depth 4 (Huginn) or 1 (Ouro):
#    bench-FAMILY-DTYPE.md and .json. REF_HUGINN / REF_OURO: folders of the public modeling code
#    (bench/reference_parity.py says which files); their generate needs the transformers they
#    were written for: Huginn's raven_modeling_minimal.py runs under 4.53.3, ouro_rl's
#    modeling_ouro.py under 4.57.6. REF_WHEELS/huginn and REF_WHEELS/ouro hold each one's wheels
#    (calibrate/fetch-gpu-wheels.sh), unpacked first on the path of that family's bench alone.
#    A reference that fails, or loads and runs past REF_SECONDS (default 90), is named after
#    the bench's table, which is kept.
#    EXITS=1 (default), after stage 3: the same with adaptive depth, each token exiting at a
#    depth drawn from EXITS_HUGINN / EXITS_OURO (forced exits; default a spread around R/2):
#    bench-exits-FAMILY-DTYPE.md and .json, what `costmodel predict --exit-depths` prices.
# 3. Each mode in MODES (default on CUDA: eager and graphs; on a CPU: eager): random-weight
#    models at the real sizes (timing needs no trained weights) fitted with the small and mid
#    variants, the base variant (about 230 MB) held out: gpu-FAMILY-DTYPE.json (eager) or
#    gpu-FAMILY-DTYPE-graphs.json, each with its plot and .validation.json; with both modes,
#    gpu-FAMILY-DTYPE-modes.json fits them together and validates each mode's fit on the other
#    (`costmodel join-modes`). The held-out DtV and WFD runs sweep the forced acceptance over
#    ACCEPTANCES (default 0.6,0.75,0.9) at the model's default draft depth.
# 4. BATCH=1 (default on CUDA): bench/batch_decode.py in eager mode (graphs would capture a graph
#    per combination of the sequences' slots) against the family's eager profile of stage 3, at
#    BATCHES (default 1 2 4 8 16), DtV at BATCH_BLOCK_LENGTHS (default 2 4 8), a run taken
#    again under load at most BATCH_RETRIES times (default 2): batch-FAMILY-DTYPE.md and .json.
#
# A step that fails is reported and the script goes on with the next one that does not need it:
# on a lent machine one failure must not cost the rest of the lease. It exits 1 at the end,
# naming the failed and skipped steps.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bf16}
SIZES=${SIZES:-real}
RESULTS=${RESULTS:-out/gpu-run}
ARCHIVE=${ARCHIVE:-$RESULTS.tar.gz}
PY=${PYTHON:-python3}
STEP_SECONDS=${STEP_SECONDS:-1800}
BUDGET_SECONDS=${BUDGET_SECONDS:-36000}
mkdir -p "$RESULTS" "$(dirname "$ARCHIVE")"
RESULTS=$(cd "$RESULTS" && pwd)
LOG="$RESULTS/campaign.log"
exec > >(tee -a "$LOG") 2> >(tee -a "$LOG" >&2)
unpack() {  # unpack DIR: its wheels into a new folder, printed (not installed: no pip needed)
  local site; site=$(mktemp -d)
  "$PY" -c "import sys, zipfile, pathlib; [zipfile.ZipFile(w).extractall(sys.argv[2]) for w in sorted(pathlib.Path(sys.argv[1]).glob('*.whl'))]" "$1" "$site" && echo "$site"
}
if [ -n "${WHEELS:-}" ]; then
  SITE=$(unpack "$WHEELS") || exit 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
FAILED=()
pack() {  # a log still being written is packed as it stands
  tar --warning=no-file-changed -czf "$ARCHIVE" -C "$(dirname "$RESULTS")" \
    "$(basename "$RESULTS")"
  [ $? -le 1 ] && echo "packed $(tar -tzf "$ARCHIVE" | grep -vc '/$') files into $ARCHIVE"
}
trap pack EXIT
step() {  # step NAME OUTPUT COMMAND...: run it under the step's timeout, its standard output to
  # the file OUTPUT (or shown, for -); on failure, say so and remember it
  local name=$1 output=$2 rc=0 left=$((BUDGET_SECONDS - SECONDS)); shift 2
  if [ "$left" -le 0 ]; then
    echo "SKIPPED: $name (the budget of $BUDGET_SECONDS s is spent)" >&2
    FAILED+=("$name (skipped)")
    return 1
  fi
  local started=$SECONDS
  if [ "$output" = - ]; then
    timeout "$((left < STEP_SECONDS ? left : STEP_SECONDS))" "$@" || rc=$?
  else
    timeout "$((left < STEP_SECONDS ? left : STEP_SECONDS))" "$@" > "$output" || rc=$?
  fi
  # each step's seconds in the log: what a lease's time went to
  echo "STEP: $name, $((SECONDS - started)) s (exit $rc)" >&2
  [ "$rc" -eq 0 ] && return 0
  [ "$rc" -eq 124 ] && echo "TIMED OUT: $name" >&2
  echo "FAILED: $name (exit $rc)" >&2
  FAILED+=("$name")
  return 1
}
QUICK_FLAG=$([ "${QUICK:-0}" = "1" ] && echo --quick || true)
if [ "${DEVICE%%:*}" = cuda ]; then
  MODES=${MODES:-eager graphs}; BENCH_MODES=${BENCH_MODES:-eager graphs}; BATCH=${BATCH:-1}
else
  MODES=${MODES:-eager}; BENCH_MODES=${BENCH_MODES:-eager}; BATCH=${BATCH:-0}
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
if [ "${SMOKE:-1}" = "1" ]; then
  step "smoke" - "$PY" calibrate/gpu_smoke.py --device "$DEVICE" --dtype "$DTYPE" \
    --json "$RESULTS/smoke.json"
fi
FAMILIES=${FAMILIES:-huginn ouro}
models() {  # models FAMILY: "fit-models holdout-model bench-model"
  if [ "$SIZES" = "real" ]; then
    local big=$([ "$1" = huginn ] && echo huginn-3.5b || echo ouro-2.6b)
    echo "$1-small:random,$1-mid:random,$big:random $1-base:random $big:random"
  elif [ "$SIZES" = "smallest" ]; then  # a rehearsal of the steps: nothing really held out
    echo "$1-tiny:random $1-tiny:random $1-tiny:random"
  else
    echo "$1-tiny:random $1-small:random $1-tiny:random"
  fi
}
# stage by stage, every family's at each: the headline figures (the decode bench) come first,
# so a lease cut short still has them for both families
if [ "${BENCH:-1}" = "1" ]; then
  for family in $FAMILIES; do
    read -r _ _ bench_model <<< "$(models "$family")"
    draft=$([ "$family" = huginn ] && echo 4 || echo 1)
    ref_var="REF_${family^^}"
    ref_flag=${!ref_var:+--reference-$family ${!ref_var} --reference-seconds ${REF_SECONDS:-90}}
    ref_site=""  # the reference's own transformers, first on the path for this step alone
    if [ -n "$ref_flag" ] && [ -d "${REF_WHEELS:-/nonexistent}/$family" ]; then
      ref_site=$(unpack "$REF_WHEELS/$family")
    fi
    step "$family benchmark" "$RESULTS/bench-$family-$DTYPE.md" \
      env PYTHONPATH="${ref_site:+$ref_site:}$PYTHONPATH" \
      "$PY" bench/decode_speed.py schedules --models "$bench_model" --device "$DEVICE" \
      --dtype "$DTYPE" --modes $BENCH_MODES --context "${BENCH_CONTEXT:-1024}" \
      --new-tokens "${BENCH_TOKENS:-256}" --repeats "${BENCH_REPEATS:-2}" --prompts 1 \
      --draft-depth "$draft" --block-lengths 2 4 8 --acceptance 0.9 $ref_flag \
      --out "$RESULTS/bench-$family-$DTYPE.json" && cat "$RESULTS/bench-$family-$DTYPE.md"
    echo "$family benchmarked at $SECONDS s"
  done
fi
for family in $FAMILIES; do
  read -r fit holdout _ <<< "$(models "$family")"
  calibrated=" "
  for mode in $MODES; do
    name="gpu-$family-$DTYPE$([ "$mode" = graphs ] && echo -graphs || true)"
    # --force: an unattended run keeps its profile, flagged if the machine was busy (a GPU's
    # never is; a CPU rehearsal beside other work can be), rather than lose the run; --retries 0:
    # a GPU takes nothing again anyway, and a CPU rehearsal checks the steps, not the figures
    if ! step "$family $mode calibration" "$RESULTS/$name.validation.json" \
        "$PY" -m calibrate.cli calibrate --model "$family" --device "$DEVICE" --dtype "$DTYPE" \
        --mode "$mode" $QUICK_FLAG --fit-models "$fit" --holdout-model "$holdout" --force \
        --retries 0 \
        ${MACHINE_FROM:+--machine-from "$MACHINE_FROM"} \
        --acceptances "${ACCEPTANCES:-0.6,0.75,0.9}" --out "$RESULTS/$name.json" --json; then
      continue
    fi
    # the machine is measured once per run: later calibrations reuse the first one's peaks
    MACHINE_FROM=${MACHINE_FROM:-$RESULTS/$name.json}
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1], 'median', round(r['median_rel_error'],3), 'max', round(r['max_rel_error'],3))" "$RESULTS/$name.validation.json"
    echo "$family $mode calibrated at $SECONDS s"
    calibrated+="$mode "
  done
  if [[ "$calibrated" == *" eager "* && "$calibrated" == *" graphs "* ]]; then
    # both modes in one fit (the device's coefficients shared), validated across the modes
    joint="gpu-$family-$DTYPE-modes"
    step "$family join-modes" - "$PY" -m calibrate.cli join-modes \
      "$RESULTS/gpu-$family-$DTYPE.json" "$RESULTS/gpu-$family-$DTYPE-graphs.json" \
      --out "$RESULTS/$joint.json" \
      && step "$family joint validation" "$RESULTS/$joint.validation.json" \
        "$PY" -m calibrate.cli validate --profile "$RESULTS/$joint.json" --json
  fi
done
# adaptive depth after the calibrations: the campaign's first figures come first
if [ "${BENCH:-1}" = "1" ] && [ "${EXITS:-1}" = "1" ]; then
  for family in $FAMILIES; do
    read -r _ _ bench_model <<< "$(models "$family")"
    draft=$([ "$family" = huginn ] && echo 4 || echo 1)
    exits_var="EXITS_${family^^}"
    if [ "$family" = ouro ]; then default_exits="2:0.5,3:0.25,4:0.25"
    elif [ "$SIZES" = real ]; then default_exits="8:0.25,12:0.25,16:0.25,24:0.25"
    else default_exits="2:0.25,3:0.25,4:0.25,6:0.25"; fi  # huginn-tiny: R = 8
    step "$family exits benchmark" "$RESULTS/bench-exits-$family-$DTYPE.md" \
      "$PY" bench/decode_speed.py schedules --models "$bench_model" --device "$DEVICE" \
      --dtype "$DTYPE" --modes $BENCH_MODES --context "${BENCH_CONTEXT:-1024}" \
      --new-tokens "${BENCH_TOKENS:-256}" --repeats 1 --prompts 1 \
      --draft-depth "$draft" --block-lengths 4 --acceptance 0.9 \
      --exit-depths "${!exits_var:-$default_exits}" \
      --out "$RESULTS/bench-exits-$family-$DTYPE.json" \
      && cat "$RESULTS/bench-exits-$family-$DTYPE.md"
  done
fi
if [ "$BATCH" = "1" ]; then
  for family in $FAMILIES; do
    read -r _ _ bench_model <<< "$(models "$family")"
    [ -f "$RESULTS/gpu-$family-$DTYPE.json" ] || continue  # it prices with the eager profile
    step "$family batch benchmark" "$RESULTS/batch-$family-$DTYPE.md" \
      "$PY" bench/batch_decode.py --model "$bench_model" --device "$DEVICE" --dtype "$DTYPE" \
      --mode eager --profile "$RESULTS/gpu-$family-$DTYPE.json" \
      --batches ${BATCHES:-1 2 4 8 16} --context "${BATCH_CONTEXT:-256}" \
      --new-tokens "${BATCH_TOKENS:-64}" --repeats "${BATCH_REPEATS:-1}" \
      --block-lengths ${BATCH_BLOCK_LENGTHS:-2 4 8} --retries "${BATCH_RETRIES:-2}" \
      --out "$RESULTS/batch-$family-$DTYPE.json" && cat "$RESULTS/batch-$family-$DTYPE.md"
  done
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'failed steps: %s\n' "$(IFS=';'; echo "${FAILED[*]}")" >&2
  exit 1
fi
