"""The paired ΔAUC that decides whether the scanner mix becomes the demo's default (issue 32 item 1).

Two stage-1 runs of the same bundle score the *same* test CTs (the pinned single-scanner demo's test
split): A trains and validates on the single-scanner demo, B on the same subjects acquired by the
scanner mix (``make_cohort(scanner_mix=...)`` keeps subjects, labels, nodules and splits of the same
seed). ``lungcal compare B A`` then gives mix minus single on those CTs with a paired bootstrap CI.
The rule of the issue: the mix becomes the default if that CI includes 0 or favours the mix.

    python experiments/scanner_mix_pair.py --output-dir runs/scanner_mix --subjects 1000 --epochs 120   # the headline
    python experiments/scanner_mix_pair.py --output-dir runs/scanner_mix_small --subjects 600 --epochs 20

It prints the two run IDs and the comparison; ``--prepare-only`` writes the datalists and prints the commands.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from lungcal.data.manifest import load_manifest, save_manifest
from lungcal.data.synthetic import ensure_demo_cohort


def paired_datalists(root: Path, subjects: int, mix: str) -> tuple[Path, Path]:
    """(single-scanner datalist, mix datalist whose test rows are the single-scanner test CTs)."""
    single = ensure_demo_cohort(root / "data", n_subjects=subjects)
    mixed = ensure_demo_cohort(root / "data", n_subjects=subjects, scanner_mix=mix)
    a, b = load_manifest(single), load_manifest(mixed)
    if [(r["subject"], r["split"], r["label"]) for r in a] != [(r["subject"], r["split"], r["label"]) for r in b]:
        raise SystemExit("the two cohorts do not hold the same subjects in the same splits")
    rows = [r for r in b if r["split"] != "test"] + [r for r in a if r["split"] == "test"]
    out = save_manifest(rows, root / f"mix_train_single_test_{subjects}.json", source="synthetic")
    return Path(single), out


def run_bundle(datalist: Path, args: argparse.Namespace, name: str) -> str:
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/nlst_focal.json",
           "--datalist", str(datalist), "--output_dir", str(args.output_dir), "--epochs", str(args.epochs),
           "--run_name", name, "--num_workers", str(args.workers), "--test_pictures", "none"]
    print(" ".join(cmd), flush=True)
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    print(text[-3000:], flush=True)
    found = re.findall(r"([0-9a-f]{32}) \(stage 1\)", text)
    if not found:
        raise SystemExit(f"no stage-1 run id in the output of {name}")
    return found[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--subjects", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--mix", default="four_vendors")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prepare-only", action="store_true")
    args = p.parse_args()
    args.output_dir = args.output_dir.absolute()
    single, mixed = paired_datalists(args.output_dir, args.subjects, args.mix)
    if args.prepare_only:
        print(json.dumps({"single": str(single), "mix_train_single_test": str(mixed)}, indent=1))
        return
    run_a = run_bundle(single, args, f"single-{args.subjects}-e{args.epochs}")
    run_b = run_bundle(mixed, args, f"mix-{args.subjects}-e{args.epochs}")
    uri = f"sqlite:///{args.output_dir / 'mlflow.db'}"
    cmd = ["lungcal", "compare", run_b, run_a, "--metrics", "auc", "ece", "--tracking-uri", uri]
    print(" ".join(cmd), flush=True)
    subprocess.run([sys.executable, "-m", "lungcal.cli", *cmd[1:]], check=True)


if __name__ == "__main__":
    main()
