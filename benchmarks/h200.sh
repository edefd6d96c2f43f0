#!/usr/bin/env bash
# One call on the H200 device machine: `bash benchmarks/h200.sh STEP...`, run from the repo
# root, with `.whl` (fla wheels) and `.corpus` carried. Each step is bounded by its own
# timeout so one failure does not eat the call. At most 8 files come back, so the model
# shards go to $OUT as they are and everything else in one results.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1 SPECLA_COMMIT=${SPECLA_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGE=/tmp/specla-stage; rm -rf "$STAGE"; mkdir -p "$STAGE"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
RUN=/tmp/specla-run

smoke() {  # the versions there differ from CI's (DESIGN §9)
  python3 - <<'PY'
import sys, torch, triton, transformers, fla, specla
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "fla", fla.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name())
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

responses() {  # responses MINUTES: the demo target's own answers, the drafter's data
  timeout $(( ${1%.*} * 60 + 120 )) python3 -m specla.cli data responses --target specla/models/demo \
    --out /tmp/responses.npz --corpus .corpus --max-minutes "$1" --no-graphs
  cp /tmp/responses.npz "$STAGE"/
}

drafter() {  # drafter MINUTES: train the EAGLE drafter of the demo target
  timeout $(( ${1%.*} * 60 + 120 )) python3 -m specla.cli train drafter --target specla/models/demo \
    --data /tmp/responses.npz --out /tmp/drafter-run --max-minutes "$1" --total-minutes "$1"
  mkdir -p "$STAGE/drafter"
  cp /tmp/drafter-run/train_log.jsonl /tmp/drafter-run/export/* "$STAGE/drafter/"
}

bench() {  # bench NAME [ARGS...]
  local name=$1; shift
  timeout "${BENCH_TIMEOUT:-420}" python3 -m specla.cli bench "$name" "$@" --out "$STAGE" 2>&1 | tee "$STAGE/bench-$name.log"
}

for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    smoke) smoke ;;
    train:*) IFS=: read -r _ mins total <<<"$step"; train "$mins" "$total" ;;
    responses:*) responses "${step#responses:}" ;;
    drafter:*) drafter "${step#drafter:}" ;;
    bench:*) bench "${step#bench:}" ;;
    *) echo "unknown step $step" ;;
  esac
  tar czf "$OUT/results.tgz" -C "$STAGE" .  # after every step: a call cut short keeps what finished
done
echo "=== done $(date +%T)"
ls -la "$OUT" "$STAGE"
