#!/usr/bin/env bash
# DistilDP offline comparison (what `make distill-offline` runs): teacher -> synth -> distill, and the baselines,
# on Amazon multi-domain reviews with SmolLM2-135M, then the table (benchmarks/collect_distill.py).
# Two chains run side by side: [teacher ε=2 -> synth -> DistilDP -> synthetic-only] and
# [zero-shot student -> pretrained SmolLM2 (all 30 layers, untrained) -> DP-SGD student (-> DPKD: teacher ε=1 -> DP-SGD on the KD loss, when DPKD=1)].
# Usage: benchmarks/distill_offline.sh RUNS_DIR DATA_DIR     (env: N_SYNTH, MAX_NEW_TOKENS, DPKD, BIN)
set -euo pipefail
RUNS=${1:-runs/distill-offline}
DATA=${2:-../shared/data/amazon_multidomain_sentiment}
BIN=${BIN:-.venv/bin}
N_SYNTH=${N_SYNTH:-400}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-32}
DPKD=${DPKD:-1}
mkdir -p "$RUNS"

step() {  # name, command...: skip what already finished, log each step
    local name=$1; shift
    if [ -f "$RUNS/$name/result.json" ] || [ -f "$RUNS/$name/provenance.json" -a "$name" = synthetic ]; then
        echo "[$name] done already"; return; fi
    echo "[$name] $(date -u +%H:%M:%S) start"
    "$@" > "$RUNS/$name.log" 2>&1
    echo "[$name] $(date -u +%H:%M:%S) done"
}
resume_or_out() {  # an interrupted run directory is resumed, a fresh one created
    if [ -f "$RUNS/$1/resolved.yaml" ]; then echo "--resume $RUNS/$1"; else echo "--out $RUNS/$1"; fi
}
recipe_args() { [ -f "$RUNS/$2/resolved.yaml" ] || echo "$1"; }

teacher_chain() {
    step teacher-eps2 $BIN/dptext finetune $(recipe_args "recipes/amazon-teacher.yaml data.path=$DATA" teacher-eps2) \
        $(resume_or_out teacher-eps2)
    step synthetic $BIN/dptext synth "$RUNS/teacher-eps2" --out "$RUNS/synthetic" --n "$N_SYNTH" \
        --max-new-tokens "$MAX_NEW_TOKENS" --batch-size 16 --validation-fraction 0.05 --check-training-copies
    local common="data.path=$DATA distill.teacher=$RUNS/teacher-eps2 distill.synthetic=$RUNS/synthetic"
    step distildp $BIN/dptext distill $(recipe_args "recipes/amazon-distill.yaml $common" distildp) \
        $(resume_or_out distildp)
    step synthetic_only $BIN/dptext distill $(recipe_args "recipes/amazon-distill.yaml $common \
        distill.method=synthetic_only name=amazon-distill-synthetic-only" synthetic_only) $(resume_or_out synthetic_only)
}

baseline_chain() {
    step zero_shot $BIN/dptext distill recipes/amazon-distill.yaml data.path="$DATA" distill.method=zero_shot \
        name=amazon-distill-zero-shot --out "$RUNS/zero_shot"
    step pretrained $BIN/dptext distill recipes/amazon-distill.yaml data.path="$DATA" distill.method=zero_shot \
        "distill.student_layers=[]" name=amazon-pretrained --out "$RUNS/pretrained"
    step dp_sgd $BIN/dptext distill $(recipe_args "recipes/amazon-distill-dpsgd.yaml data.path=$DATA" dp_sgd) \
        $(resume_or_out dp_sgd)
    if [ "$DPKD" = 1 ]; then
        step teacher-eps1 $BIN/dptext finetune $(recipe_args "recipes/amazon-teacher.yaml data.path=$DATA \
            privacy.target_epsilon=1 privacy.delta=0.0005 name=amazon-teacher-eps1" teacher-eps1) $(resume_or_out teacher-eps1)
        step dpkd $BIN/dptext distill $(recipe_args "recipes/amazon-distill-dpkd.yaml data.path=$DATA \
            distill.teacher=$RUNS/teacher-eps1" dpkd) $(resume_or_out dpkd)
    fi
}

teacher_chain & first=$!
baseline_chain & second=$!
wait $first; wait $second
$BIN/python benchmarks/collect_distill.py "$RUNS"
