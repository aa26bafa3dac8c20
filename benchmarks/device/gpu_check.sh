#!/bin/bash
# Issue 44's GPU check in one command that fits ~8 minutes on one H100 (GPU_CHECK_SECONDS, default 480 with the
# install; the CPU rehearsal 1440, shared alike), each step time-boxed with `timeout` and recorded as it ends, so a
# run cut off still leaves what it has:
#   1. exactness: benchmarks/gpu_exactness.py, the engine against fp64 brute force in fp32 and bf16 -> exactness.json
#   2. speed and memory: dptext bench-memory on smollm2-135m, bf16 autocast, T in {256, 1024} x B in {8, 32}
#      (the largest batch searched once per T, at B = 8) -> bench.json (every report in one list)
#   3. scale: benchmarks/max_model.py, the largest model non-private vs DP -> max_model.json
# plus meta.json (device, commit, packages, each step's status and wall seconds) and log.txt, all under $OUT (a new
# temporary folder when unset), then the tables of benchmarks/collect_gpu.py.
#   On a lent GPU (benchmarks/RESULTS.md): benchmarks/device/bundle.sh --check here, then one call carrying .gpu:
#     bash benchmarks/device/gpu_check.sh --device cuda    (installs from .gpu first, as go.sh does: install.sh)
#   Only some steps (a later GPU session completing an earlier run; collect_gpu.py merges the two $OUTs):
#     bash benchmarks/device/gpu_check.sh --device cuda --only scale,bench-T1024-B8   (bench = every bench step)
#   and, only when asked: --only profile (where a step's time goes: benchmarks/device/profile_step.py),
#   --only finetune (dptext finetune end to end on a 512-record E2E slice, the micro-batch picked by the probe)
#   The CPU rehearsal (tests/test_gpu_check.py): bash benchmarks/device/gpu_check.sh --device cpu --tiny
#     (the current environment, no install; PYTHON names its interpreter; tiny-llama at T = 16, B = 2).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=cuda TINY=false ONLY=
while [ $# -gt 0 ]; do
  case $1 in
    --device) DEVICE=${2:-}; shift 2 || shift ;;
    --tiny) TINY=true; shift ;;
    --only) ONLY=${2:-}; shift 2 || shift ;;
    *) echo "usage: gpu_check.sh [--device cuda|cpu] [--tiny] [--only STEP,...]" >&2; exit 2 ;;
  esac
done
case $DEVICE in cuda|cpu) ;; *) echo "gpu_check.sh: --device is cuda or cpu, not '$DEVICE'." >&2; exit 2 ;; esac
for name in ${ONLY//,/ }; do
  case $name in exactness|bench|bench-T*-B*|scale|profile|finetune) ;;
    *) echo "gpu_check.sh: --only takes exactness, bench, bench-T<T>-B<B>, scale, profile, finetune, not '$name'." >&2
       exit 2 ;;
  esac
done
OUT=${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
WORK=$(mktemp -d -t gpu_check_work.XXXXXX)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
BUDGET=${GPU_CHECK_SECONDS:-$([ "$DEVICE" = cuda ] && echo 480 || echo 1440)}
PYTHON=${PYTHON:-python3}
RECORD="$PYTHON benchmarks/device/check_record.py"
FAILED=0
echo "gpu_check: device $DEVICE, tiny $TINY, ${BUDGET} s in all, results in $OUT"

# share S: S seconds of the 480 planned for the H100, in proportion to this run's budget
share() { echo $((BUDGET * $1 / 480)); }
# limit CAP KEEP: a step's seconds, at most CAP and never into the KEEP seconds kept for the steps after it
limit() { local left=$((BUDGET - SECONDS - $2)); echo $(($1 < left ? $1 : left)); }
# wanted NAME: whether --only (exactness, bench, bench-T..-B.., scale; none: all) asks for the step
wanted() {
  [ -z "$ONLY" ] && return 0
  case ",$ONLY," in *",$1,"*) return 0 ;; esac
  [[ $1 == bench-* && ",$ONLY," == *,bench,* ]] && return 0
  return 1
}
# step NAME SECONDS COMMAND...: run it under `timeout` (its whole process group), then record it in meta.json
step() {
  local name=$1 cap=$2 started=$SECONDS rc
  shift 2
  wanted "$name" || return 0
  if [ "$cap" -lt 10 ]; then
    $RECORD step "$OUT" "$name" 124 0 "$cap" --note "skipped: no time left"; FAILED=1; return
  fi
  echo "== $name (at most $cap s): $*"
  timeout -k 10 "$cap" "$@"
  rc=$?
  $RECORD step "$OUT" "$name" $rc $((SECONDS - started)) "$cap"
  [ $rc -eq 0 ] || FAILED=1
}

if [ "$DEVICE" = cpu ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # tiny models: a second thread only waits, on a busy machine for long
else
  timeout -k 10 "$(limit "$(share 150)" "$(share 300)")" bash benchmarks/device/install.sh --random-smollm2 || exit 1
  source benchmarks/device/env.sh
  installed=$SECONDS
fi
if $TINY; then
  TINY_FLAG=--tiny MODEL=tiny-llama CONFIGS="16,2" LARGEST_AT=2 BENCH_STEPS="--steps 2 --warmup 1"
else
  TINY_FLAG= MODEL=smollm2-135m CONFIGS="256,8 256,32 1024,8 1024,32" LARGEST_AT=8 BENCH_STEPS=
fi
$RECORD start "$OUT" --device "$DEVICE" $TINY_FLAG || exit 1
[ "$DEVICE" = cuda ] && $RECORD step "$OUT" install 0 "$installed" "$(share 150)"

# 1. exactness, at most 110 s (keeps 320 s for the benchmark and the scale step)
step exactness "$(limit "$(share 110)" "$(share 320)")" $PYTHON benchmarks/gpu_exactness.py --device "$DEVICE" \
  $TINY_FLAG --out "$OUT/exactness.json"

# 2. speed and memory, one bench-memory per (T, B), together at most 210 s (keeps 110 s for the scale step)
bench_end=$((SECONDS + $(limit "$(share 210)" "$(share 110)")))
for config in $CONFIGS; do
  T=${config%,*} B=${config#*,}
  largest=--no-max-batch
  [ "$B" = "$LARGEST_AT" ] && largest=--max-batch
  step "bench-T$T-B$B" "$(limit $((bench_end - SECONDS)) "$(share 110)")" $PYTHON -m dptext bench-memory "$MODEL" \
    --seq-len "$T" --batch-size "$B" --modes nonprivate,bookkeeping,ghost,opacus,opacus_untied \
    --device "$DEVICE" --precision bf16 $largest $BENCH_STEPS --out "$WORK/bench-T$T-B$B"
  [ -f "$WORK/bench-T$T-B$B/bench.json" ] && $RECORD bench "$OUT" "$WORK/bench-T$T-B$B/bench.json"
done

# 3. scale: whatever time is left (max_model.py starts no trial in its last 45 s)
if [ -f benchmarks/max_model.py ]; then
  keep=10  # seconds kept after the scale step: for the profile and the finetune run when they are asked for
  [ -n "$ONLY" ] && wanted profile && keep=$((keep + $(share 70)))
  [ -n "$ONLY" ] && wanted finetune && keep=$((keep + $(share 150)))
  cap=$(limit 600 $keep)
  scale_flags="--time-budget $((cap > 90 ? cap - 45 : cap / 2))"
  $TINY && scale_flags="$scale_flags --tiny --layers 1"
  step scale "$cap" $PYTHON benchmarks/max_model.py --device "$DEVICE" --out "$OUT/max_model.json" $scale_flags
else
  $RECORD step "$OUT" scale 0 0 0 --note "skipped: benchmarks/max_model.py is not in this tree"
fi

# 4. where the step's time goes (benchmarks/device/profile_step.py): only when asked, --only profile
if [ -n "$ONLY" ] && wanted profile; then
  profile_flags=$($TINY && echo "--model tiny-llama --seq-len 16 --batch-size 2 --steps 1")
  after=0  # seconds kept for the finetune step when it is asked for too
  wanted finetune && after=$(share 150)
  step profile "$(limit "$(share 70)" $after)" $PYTHON benchmarks/device/profile_step.py --device "$DEVICE" \
    $profile_flags --out "$OUT/profile.json"
fi

# 5. dptext finetune end to end, only when asked (--only finetune): E2E with DP-Adam as recipes/e2e-cpu-dp.yaml, on
#    512 records for one epoch (4 steps), the micro-batch left to the memory probe, greedy evaluation of 8; the
#    run's result.json and metrics.jsonl go to $OUT/finetune
if [ -n "$ONLY" ] && wanted finetune; then
  e2e=$([ -d .gpu/e2e_small ] && echo .gpu/e2e_small || echo ../shared/data/e2e_nlg)
  model=$($TINY && echo tiny-llama || echo smollm2-135m)
  step finetune "$(limit "$(share 150)" 0)" $PYTHON -m dptext finetune recipes/e2e-cpu-dp.yaml data.path="$e2e" \
    model.name="$model" data.max_train_examples=512 data.max_eval_examples=8 train.epochs=1 \
    train.physical_batch_size= train.device="$DEVICE" eval.beam_size=1 eval.max_new_tokens=16 --out "$WORK/finetune"
  mkdir -p "$OUT/finetune"
  cp "$WORK"/finetune/{result.json,metrics.jsonl,provenance.json} "$OUT/finetune/" 2>/dev/null
fi

echo "== the tables (benchmarks/collect_gpu.py; collect with it into benchmarks/results/bench_gpu.json)"
$PYTHON benchmarks/collect_gpu.py "$OUT" --out "$WORK/bench_gpu.json" || FAILED=1
echo "gpu_check: $((SECONDS)) s, results in $OUT$([ $FAILED -eq 0 ] || echo ', some step failed (meta.json)')"
rm -rf "$WORK"
exit $FAILED
