#!/usr/bin/env bash
# One GPU, under 10 minutes: does the GPU path run, and how fast?
#   - one CIFAR-10 epoch on a 2,000-image subset per stage-1 method (ce, focal, mixup, focal_mixup):
#     CPU generators for every sampling draw, float32 evaluation logits, TS on validation;
#   - one CT epoch of bundles/nlst_focal.json on a 60-CT synthetic cohort (AMP as the bundle says);
#   - CIFAR training img/s with and without AMP / channels_last (scripts/bench_cifar.py).
# Usage (project root, README install done):  bash scripts/gpu_check.sh [OUT_DIR]
# DEVICE=cpu runs the same steps on the CPU (slow; for checking the script itself).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-cuda}"
OUT="${1:-${OUT:-runs/gpu_check}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export LUNGCAL_HOME="$OUT/home"
if [ "$DEVICE" = "cuda" ]; then
  python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: run this on a GPU machine, or DEVICE=cpu')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', '$DEVICE')"
STORE="sqlite:///$OUT/mlflow.db"
t0=$(date +%s)

echo "== CIFAR-10: one epoch per stage-1 method on $DEVICE"
for m in ce focal mixup focal_mixup; do
  s=$(date +%s)
  python -m monai.bundle run --config_file "['bundles/cifar10lt_ce.json','bundles/cifar10_${m}.json']" \
    --device "$DEVICE" --epochs 1 \
    --subset 2000 --val_per_class 50 --n_bootstrap 100 --output_dir "$OUT/cifar" --tracking_uri "$STORE" \
    > "$OUT/cifar_${m}.log" 2>&1 || { echo "cifar10_${m}: FAILED (see $OUT/cifar_${m}.log)"; tail -5 "$OUT/cifar_${m}.log"; exit 1; }
  echo "cifar10_${m}: ok in $(( $(date +%s) - s )) s"; grep -E "ECE|temperature" "$OUT/cifar_${m}.log" | tail -3 || true
done

echo "== CT: one epoch of nlst_focal on a 60-CT synthetic cohort on $DEVICE"
s=$(date +%s)
python -m monai.bundle run --config_file bundles/nlst_focal.json --device "$DEVICE" --epochs 1 --demo_subjects 60 \
  --n_bootstrap 100 --output_dir "$OUT/ct" --tracking_uri "$STORE" > "$OUT/ct.log" 2>&1 \
  || { echo "nlst_focal: FAILED (see $OUT/ct.log)"; tail -5 "$OUT/ct.log"; exit 1; }
echo "nlst_focal: ok in $(( $(date +%s) - s )) s"; grep -A3 "== lungcal" "$OUT/ct.log" | head -4 || true

echo "== CIFAR training throughput (ResNet-32, batch 128) on $DEVICE"
for amp in on off; do
  for cl in on off; do
    echo "-- AMP $amp, channels_last $cl"
    python scripts/bench_cifar.py --device "$DEVICE" --steps 40 --repeats 2 --no-plain --amp "$amp" \
      --channels-last "$cl" --threads "$(nproc)" | sed -n '1,3p'
  done
done
echo "== gpu_check done in $(( $(date +%s) - t0 )) s; logs and MLflow store in $OUT"
