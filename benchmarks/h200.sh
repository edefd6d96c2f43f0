#!/usr/bin/env bash
# One lane of a call on the H200 device machine: `LANE=a bash benchmarks/h200.sh STEP...`,
# run from the repo root, with `.whl` (fla wheels), `.corpus` (when collecting responses: the
# 1.6 MB `specla data prompt-corpus` copy does; the full corpus does not fit beside the repo) and
# `.run` (earlier runs' data) carried. On a two-GPU machine run two lanes side by side, each
# with its own CUDA_VISIBLE_DEVICES. Each step is bounded by its own timeout so one failure
# does not eat the call. At most 8 files come back: each lane packs its logs and results in
# results-$LANE.tgz after every step; trained drafters come back as one .tgz each.
# In a step's ARG list commas separate arguments; write a comma inside one argument as %
# (`bench:e2e:300:--routes,ar%chain%tree`). Start lanes in the background and `wait` for them
# rather than sleeping a fixed time: a lane that fails early then ends the call early. Export
# SPECLA_COMMIT / SPECLA_COMPILE in a statement of its own before the lanes: in
# `export X=1 && (lane a) & (lane b) & wait` the export runs inside lane a's background job
# only, and lane b runs without it (this cost the shard-1 e2e records of 2026-12-01). A first
# step `card:H200` ends the lane with status 3 on any other card (a call for the H200 kind is
# served by an H100 when one is free): chain later lanes with && so the call stops right after
# the machine's start.
# LANE_SECONDS=N: the lane's whole time; each diag and bench step's own bound is cut to what is
# left of it less 15 s, so the lane still packs what the step wrote (an outer `timeout` that
# fires mid-step loses that step's files: the e2e records of 2026-12-07's fourth call).
set -uo pipefail
export PYTHONUNBUFFERED=1 SPECLA_COMMIT=${SPECLA_COMMIT:-unknown}
LANE=${LANE:-a}
END=$(( SECONDS + ${LANE_SECONDS:-86400} ))

left() {  # left SECONDS: a step's bound, cut to the lane's time left less 15 s (at least 1)
  local want=$1 rest=$(( END - SECONDS - 15 ))
  (( rest < want )) && want=$rest
  (( want < 1 )) && want=1
  echo "$want"
}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGE=/tmp/specla-stage-$LANE; rm -rf "$STAGE"; mkdir -p "$STAGE"
if [ -n "${SRC:-}" ]; then  # SRC=DIR: run the lane on another commit's tree, carried as an ignored
  # folder (`bash benchmarks/old_tree.sh REV`: its code without specla/models, which it takes
  # from here), so two commits are timed in one call on one machine
  [ -d "$SRC/specla/models" ] || cp -r specla/models "$SRC/specla/"
  for d in .whl .run .corpus; do [ -e "$d" ] && [ ! -e "$SRC/$d" ] && cp -r "$d" "$SRC/"; done
  cd "$SRC" || exit 1
fi
if [ -d .whl ]; then
  mkdir -p /tmp/site-lock
  ( flock 9; [ -f /tmp/site/.done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.done; } ) 9>/tmp/site-lock/lock
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
RUN=/tmp/specla-run
BD=/tmp/block-drafters
SPECLA=${SPECLA:-python3 -m specla.cli}

smoke() {  # the versions there differ from CI's (DESIGN §9)
  python3 - <<'PY'
import sys, torch, triton, transformers, fla, specla
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "fla", fla.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(), "specla from", specla.__file__)
PY
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
}

train() {  # train MINUTES [TOTAL_MINUTES]
  local extra=()
  [ -f "$RUN/ckpt.pt" ] || [ ! -d .run/export ] || extra=(--init-from .run/export)
  timeout $(( ${1%.*} * 60 + 150 )) python3 -m specla.cli train target --out "$RUN" --corpus .corpus \
    --max-minutes "$1" --total-minutes "${2:-12}" --batch-size 32 "${extra[@]}"
  mkdir -p "$STAGE/export"
  cp "$RUN"/train_log.jsonl "$STAGE"/
  cp "$RUN"/export/*.json "$STAGE"/export/
  cp "$RUN"/export/*.safetensors "$OUT"/
}

responses() {  # responses MINUTES SHARDS [ARGS...]: the demo target's own answers (the drafters' data),
  # SHARDS processes side by side on this lane's GPU (eager decoding leaves it mostly idle)
  local mins=$1 n=${2:-1} k; shift 2
  for k in $(seq 0 $((n - 1))); do
    timeout $(( ${mins%.*} * 60 + 150 )) $SPECLA data responses --target specla/models/demo --out /tmp/responses.$k.npz \
      --corpus .corpus --max-minutes "$mins" --no-graphs --shard "$k/$n" "$@" > "$STAGE/responses.$k.log" 2>&1 &
  done
  wait
  $SPECLA data merge-responses --out /tmp/responses.npz /tmp/responses.*.npz
  tail -n 1 "$STAGE"/responses.*.log
  cp /tmp/responses.npz "$OUT"/
}

pack() {  # pack NAME DIR: a trained export comes back as $OUT/NAME.tgz
  [ -d "$2/export" ] && cp "$2"/train_log.jsonl "$2/export/" && tar czf "$OUT/$1.tgz" -C "$2/export" .
}

drafter() {  # drafter MINUTES [ARGS...]: train the EAGLE drafter of the demo target
  local mins=$1; shift
  timeout $(( ${mins%.*} * 60 + 120 )) $SPECLA train drafter --target specla/models/demo \
    --data /tmp/responses.npz --out /tmp/drafter-run --max-minutes "$mins" --total-minutes "$mins" "$@" \
    > "$STAGE/drafter.log" 2>&1
  pack drafter /tmp/drafter-run
}

block() {  # block NAME MINUTES ARGS...: one block-drafter training run, log in the stage;
  # $BLOCK_ARGS goes to every run (a CPU rehearsal of a plan: "--batch-size 4 --seq-len 256 --device cpu")
  local name=$1 mins=$2; shift 2
  # shellcheck disable=SC2086
  timeout $(( ${mins%.*} * 60 + 120 )) $SPECLA train drafter --target specla/models/demo --data /tmp/responses.npz \
    --out "$BD/$name" --max-minutes "$mins" --total-minutes "$mins" "$@" ${BLOCK_ARGS:-} > "$STAGE/$name.log" 2>&1
  tail -n 1 "$STAGE/$name.log"
}

blocks() {  # blocks DSPARK_MIN ADAPT_MIN [ADAPT_STEPS]: DSpark from scratch, then `adapt`
  block dspark "$1" --kind dspark
  adapt "$2" "${3:-}"
}

adapt() {  # adapt ADAPT_MIN [ADAPT_STEPS]: from $BD/dspark/export (or a carried .run/blocks/dspark),
  # ReaDy (stage 1 and 2, half the adaptation each) beside the fine-tuned control (the whole
  # adaptation). By time alone the control, ~1.5x faster a step, ran 2,740 steps to ReaDy's 2,185
  # (aa91f03); with ADAPT_STEPS each stage runs half of them and the control all, ADAPT_MIN a run's cap
  local half=$1 s1=() s2=() ft=()
  if [ ! -d "$BD/dspark/export" ]; then mkdir -p "$BD/dspark" && cp -r .run/blocks/dspark "$BD/dspark/export"; fi
  if [ -n "${2:-}" ]; then
    s1=(--total-steps $(( $2 / 2 ))); s2=(--total-steps $(( $2 - $2 / 2 ))); ft=(--total-steps "$2")
  else
    half=$(python3 -c "print($1 / 2)")
  fi
  ( block ready1 "$half" --kind ready --stage 1 --init-from "$BD/dspark/export" "${s1[@]}" &&
    block ready "$half" --kind ready --stage 2 --init-from "$BD/ready1/export" "${s2[@]}" ) &
  block dspark-ft "$1" --kind dspark-ft --init-from "$BD/dspark/export" "${ft[@]}" &
  wait
  for n in ready dspark-ft; do pack "$n" "$BD/$n"; done
  [ -d .run/blocks/dspark ] || pack dspark "$BD/dspark"
}

ablate() {  # ablate MINUTES [STEPS]: ReaDy stage-1 variants from the committed DSpark, side by
  # side, the default reader among them so every row trained under the same conditions
  local m=$1 steps=(${2:+--total-steps $2}) v
  declare -A variants=([s1-default]="" [rank16]="--reader-rank 16" [rank32]="--reader-rank 32"
    [rankfull]="--reader-rank full" [src-low]="--source-layers 2" [src-mid]="--source-layers 6"
    [src-last]="--source-layers 11" [src-low-last]="--source-layers 2,11" [inject-first]="--inject-layers 0"
    [inject-both]="--inject-layers 0,1" [site-pre]="--inject-site pre")
  for v in "${!variants[@]}"; do
    # shellcheck disable=SC2086
    block "abl-$v" "$m" --kind ready --stage 1 --init-from specla/models/demo/dspark "${steps[@]}" ${variants[$v]} &
  done
  wait
  tar czf "$OUT/ablations.tgz" -C "$BD" $(cd "$BD" && ls -d abl-*/export)
}

bench() {  # bench NAME [ARGS...]; earlier records of a resumable bench travel in .run/NAME
  local name=$1; shift
  [ -d ".run/$name" ] && cp -r ".run/$name/." "$STAGE"/
  timeout "$(left "${BENCH_TIMEOUT:-420}")" $SPECLA bench "$name" "$@" --out "$STAGE" 2>&1 | tee "$STAGE/bench-$name.log"
}

bench_ablations() {  # bench_ablations SECONDS PROMPTS: DSpark and every trained ablation, fewer prompts
  local args=() d
  for d in "$BD"/abl-*/export; do args+=(--variant "$(basename "$(dirname "$d")")=$d"); done
  BENCH_TIMEOUT=$1 bench ready --rows dspark --name ready_ablations --n-prompts "$2" --no-operator \
    --max-minutes "$(python3 -c "print(($1 - 45) / 60)")" "${args[@]}"
}

run_step() {
  local step=$1
  echo "=== $step $(date +%T)"
  case $step in
    smoke) smoke ;;
    card:*) nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "${step#card:}" \
      || { echo "not a ${step#card:}: $(nvidia-smi --query-gpu=name --format=csv,noheader)"; exit 3; } ;;
    train:*) IFS=: read -r _ mins total <<<"$step"; train "$mins" "$total" ;;
    responses:*) IFS=: read -r _ mins n args <<<"$step"; args=${args//,/ }; responses "$mins" "${n:-1}" ${args//%/,} ;;  # responses:MIN:SHARDS[:ARG,...]
    drafter:*) IFS=: read -r _ mins args <<<"$step"; args=${args//,/ }; drafter "$mins" ${args//%/,} ;;  # drafter:MIN[:ARG,...]
    block:*) IFS=: read -r _ name mins args <<<"$step"; args=${args//,/ }; block "$name" "$mins" ${args//%/,}  # block:NAME:MIN:ARG,...
      pack "$name" "$BD/$name" ;;
    blocks:*) IFS=: read -r _ a b c <<<"$step"; blocks "$a" "$b" "$c" ;;  # blocks:DSPARK_MIN:ADAPT_MIN[:ADAPT_STEPS]
    adapt:*) IFS=: read -r _ a b <<<"$step"; adapt "$a" "$b" ;;  # adapt:ADAPT_MIN[:ADAPT_STEPS]
    join) wait ;;  # the bg: steps started so far
    ablate:*) IFS=: read -r _ mins steps <<<"$step"; ablate "$mins" "$steps" ;;
    bench-ablations:*) IFS=: read -r _ secs n <<<"$step"; bench_ablations "$secs" "$n" ;;
    diag:*) IFS=: read -r _ name secs args <<<"$step"  # diag:NAME[:SECONDS[:ARG,...]]: benchmarks/diagnostics/NAME.py
      args=${args//,/ }; timeout "$(left "${secs:-300}")" python3 "benchmarks/diagnostics/$name.py" ${args//%/,} --out "$STAGE/$name.json" 2>&1 \
        | tee "$STAGE/diag-$name.log" ;;
    bench:*) IFS=: read -r _ name secs args <<<"$step"  # bench:NAME[:SECONDS[:ARG,ARG,...]]
      args=${args//,/ }; BENCH_TIMEOUT=${secs:-${BENCH_TIMEOUT:-420}} bench "$name" ${args//%/,} ;;
    *) echo "unknown step $step" ;;
  esac
}

[ -f .run/responses.npz ] && cp .run/responses.npz /tmp/responses.npz
for step in "$@"; do
  if [[ $step == bg:* ]]; then  # bg:STEP runs beside the next steps; joined before the lane ends
    run_step "${step#bg:}" &
  else
    run_step "$step"
  fi
  tar czf "$OUT/results-$LANE.tgz" -C "$STAGE" .  # after every step: a call cut short keeps what finished
done
wait
tar czf "$OUT/results-$LANE.tgz" -C "$STAGE" .
echo "=== done $(date +%T)"
ls -la "$OUT" "$STAGE"
