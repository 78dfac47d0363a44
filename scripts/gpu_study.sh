#!/usr/bin/env bash
# The CIFAR half of the study at the full 200-epoch recipe on one GPU (issue 16 item 4, issue 36 items 1-2):
# balanced CIFAR-10 and CIFAR-10-LT, each with CE, Focal, CE+Mixup and Focal+Mixup (stage 1, each with its
# TS run) and LAS on each stage-1 model; beside them the two CIFAR-10-LT CE controls of the long-tail gap
# (weight decay 5e-4, and float32 with amp off; stage 1 and TS only). All jobs run side by side on the one
# GPU (ResNet-32 leaves most of an H200 idle). Each job logs to its own SQLite store (one writer per file:
# no "database is locked"), then `lungcal report --sections all` writes one report per store (the study
# table, accuracy by class, the post-hoc fixes). Every job resumes from its last complete epoch and a
# finished configuration is skipped, so a run cut by a time limit is finished by running it again.
# Usage (project root, README install done; ../shared/data/cifar10 beside the project):
#   bash scripts/gpu_study.sh [OUT_DIR]
# DATASETS="cifar10lt" runs one half only (default: "cifar10 cifar10lt"); CONTROLS=0 leaves out the two
# CIFAR-10-LT controls. EPOCHS=2 DEVICE=cpu checks the script itself on a CPU (a 2-epoch schedule on a
# 1000-image subset; slow, not a result).
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
# convert the shared CIFAR-10 copy once, before the jobs would each try at the same time
python -c "from cifar_baselines.data import default_data_dir, prepare_data_dir; print(prepare_data_dir(default_data_dir()))"
DATASETS="${DATASETS:-cifar10 cifar10lt}"
# jobs: "<store name> <dataset> <stage-1 method> <extra overrides...>"
JOBS=()
for d in $DATASETS; do
  for m in ce focal mixup focal_mixup; do JOBS+=("${d}_$m $d $m"); done
done
if [ "${CONTROLS:-1}" = "1" ] && [[ " $DATASETS " == *" cifar10lt "* ]]; then
  JOBS+=("cifar10lt_ce_wd5e-4 cifar10lt ce weight_decay=0.0005" "cifar10lt_ce_fp32 cifar10lt ce amp=false")
fi
t0=$(date +%s)
pids=()
for job in "${JOBS[@]}"; do
  read -r name d m extra <<< "$job"
  stage2=("${STAGE2[@]}")
  extra_o=()
  if [ -n "${extra:-}" ]; then  # a control: stage 1 and its TS only
    extra_o=(-o "$extra")
    stage2=(none ts)
  fi
  lungcal study --datasets "$d" --preset full --stage1 "$m" --stage2 "${stage2[@]}" \
    --tracking-uri "sqlite:///$OUT/$name.db" "${OVERRIDES[@]}" "${extra_o[@]}" > "$OUT/study_$name.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { rc=1; echo "study job ${JOBS[$i]} FAILED:"; tail -5 "$OUT/study_$(echo "${JOBS[$i]}" | cut -d' ' -f1).log"; }
done
echo "== stage 1 + TS + LAS done in $(( $(date +%s) - t0 )) s (rc $rc)"
# every finished run's test predictions, config, commit and data hashes, to commit under docs/results/data/study
# (issue 47 item 6: the verdicts are recomputed from these by `lungcal archive --check`, whatever happens to the stores)
for job in "${JOBS[@]}"; do
  read -r name d m extra <<< "$job"
  lungcal archive --experiment "$d" --tracking-uri "sqlite:///$OUT/$name.db" --out "$OUT/archive/$name" \
    > "$OUT/archive_$name.log" 2>&1 || { rc=1; tail -3 "$OUT/archive_$name.log"; }
done
for dir in "$OUT/archive/"*/; do
  echo "== archive $(basename "$dir"): $(lungcal archive --check "$dir" 2>&1 | tail -1)"
done
for job in "${JOBS[@]}"; do
  read -r name d m extra <<< "$job"
  echo "== $name"
  # every section: the study table, accuracy by class (many/medium/few) and the post-hoc fixes side by
  # side (TS, the ECE-best T, logit adjustment, vector scaling, against LAS)
  lungcal report --experiment "$d" --tracking-uri "sqlite:///$OUT/$name.db" --out "$OUT/report_$name" --no-log \
    --sections all > "$OUT/report_$name.log" 2>&1 \
    && grep "^| \(stage 1\|CE\|Focal\|ts\|vector\|LAS\)" "$OUT/report_$name/report.md" | grep -v " + " \
    || tail -3 "$OUT/report_$name.log"
done
exit $rc
