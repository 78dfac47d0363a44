#!/usr/bin/env bash
# The CIFAR-10-LT half of the study at the full 200-epoch recipe on one GPU (issue 16 item 4):
# CE, Focal, CE+Mixup and Focal+Mixup (stage 1, each with its TS run) and LAS on each stage-1 model,
# the four stage-1 methods side by side on the one GPU (ResNet-32 leaves most of an H200 idle).
# Each method logs to its own SQLite store (one writer per file: no "database is locked"), then
# `lungcal report --sections all` writes one report per store (the study table, accuracy by class, the
# post-hoc fixes). Every job resumes from its last complete epoch and a finished configuration is
# skipped, so a run cut by a time limit is finished by running it again.
# Usage (project root, README install done; ../shared/data/cifar10 beside the project):
#   bash scripts/gpu_study.sh [OUT_DIR]
# EPOCHS=2 DEVICE=cpu checks the script itself on a CPU (a 2-epoch schedule; slow, not a result).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-cuda}"
OUT="${1:-${OUT:-runs/gpu_study}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export LUNGCAL_HOME="$OUT/home"
if [ "$DEVICE" = "cuda" ]; then
  python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: run this on a GPU machine, or DEVICE=cpu')"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
OVERRIDES=(-o "device=$DEVICE")
STAGE2=(none ts las)
if [ -n "${EPOCHS:-}" ]; then  # a short schedule, for checking the script only
  OVERRIDES+=(-o "epochs=$EPOCHS" -o "warmup_epochs=1" -o "lr_milestones=[$EPOCHS,$EPOCHS]" -o "subset=1000")
  STAGE2=(none ts)
fi
# convert the shared CIFAR-10 copy once, before four jobs would each try at the same time
python -c "from cifar_baselines.data import default_data_dir, prepare_data_dir; print(prepare_data_dir(default_data_dir()))"
t0=$(date +%s)
pids=()
for m in ce focal mixup focal_mixup; do
  lungcal study --datasets cifar10lt --preset full --stage1 "$m" --stage2 "${STAGE2[@]}" --tracking-uri "sqlite:///$OUT/$m.db" \
    "${OVERRIDES[@]}" > "$OUT/study_$m.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { rc=1; echo "study job $i FAILED:"; tail -5 "$OUT"/study_*.log; }
done
echo "== stage 1 + TS + LAS done in $(( $(date +%s) - t0 )) s (rc $rc)"
for m in ce focal mixup focal_mixup; do
  echo "== $m"
  # every section: the study table, accuracy by class (many/medium/few) and the post-hoc fixes side by
  # side (TS, the ECE-best T, logit adjustment, vector scaling, against LAS)
  lungcal report --experiment cifar10lt --tracking-uri "sqlite:///$OUT/$m.db" --out "$OUT/report_$m" --no-log \
    --sections all > "$OUT/report_$m.log" 2>&1 \
    && grep "^| \(stage 1\|CE\|Focal\|ts\|vector\|LAS\)" "$OUT/report_$m/report.md" | grep -v " + " \
    || tail -3 "$OUT/report_$m.log"
done
exit $rc
