"""A bound on what the JPEG copy of CIFAR-10 does to the CIFAR-10-LT numbers (issue 47 item 4).

Every CIFAR row of the study trained and tested on ``../shared``'s copy of CIFAR-10, whose images were
re-encoded as JPEG (quality 75, 4:2:0, about 30 dB PSNR against the original); the official pixels are not
here, so the copy's effect cannot be removed. This control applies the same degradation once more, one
more JPEG pass (PIL, quality 75, 4:2:0) to every training and test image of the copy, trains the CIFAR-10-LT
CE recipe (``bundles/cifar10lt_ce.json``, seed 0) on each folder, and pairs the two runs on the same 10,000
test images: test ACC and ECE (15 bins) of each arm, and the differences (second pass minus the copy as is)
with paired bootstrap 95% CIs (:func:`lungcal.calibration.metrics.paired_bootstrap_diff`). It also gives
the second pass's PSNR against the copy, to set beside the copy's ~30 dB against the original: one more
pass of the same degradation moves the metrics by X, so the copy's own effect is plausibly of that order.

    python experiments/jpeg_bound.py prepare                  # the two data folders and the PSNR
    python experiments/jpeg_bound.py run --epochs 30          # both arms, one after the other (resumable)
    python experiments/jpeg_bound.py table --epochs 30 [--save docs/results/data/jpeg_bound_....npz]
    python experiments/jpeg_bound.py commands --epochs 30     # the two arms' commands, to run by hand

Everything goes under ``--root`` (default ``runs/jpeg_bound``): ``data/copy`` (the copy as is, converted by
``make_batches.py`` through :func:`cifar_baselines.data.prepare_data_dir`), ``data/q75x2`` (its second pass,
marked with :data:`cifar_baselines.data.JPEG_TWICE_MARKER`, so the runs log ``data_copy`` =
:data:`cifar_baselines.data.COPY_JPEG_TWICE`) and one MLflow store (``mlflow.db``) holding both runs. A
shortened schedule (``--epochs N``) scales the bundle's warm-up (5 of 200 epochs) and its LR milestones
(160, 180 of 200) to N; both arms share it. Each step is idempotent: a finished folder is kept, a finished
run is not trained again and an unfinished one resumes from its last epoch (the bundle's own resume).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.tracking import MlflowClient
from PIL import Image
from tqdm import tqdm

from cifar_baselines.data import (
    COPY_JPEG_TWICE,
    JPEG_TWICE_MARKER,
    data_copy,
    find_batches_dir,
    prepare_data_dir,
)
from lungcal.calibration.metrics import calibration_report, paired_bootstrap_diff
from lungcal.tracking.tracker import default_tracking_uri

QUALITY = 75
#: PIL's ``subsampling`` code for 4:2:0 (0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0)
SUBSAMPLING_420 = 2
BATCH_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
BUNDLE = "bundles/cifar10lt_ce.json"
#: the arms: name -> the grid shift of its extra JPEG pass (``None``: the copy as is); the data folder is
#: ``<root>/data/<name>``. ``q75x2`` is the pass on the copy's own 8x8 / 16x16 block grid (near idempotent:
#: re-quantising with the same tables changes little); ``q75x2_shift4`` encodes the image moved 4 pixels
#: down and right (edge-padded, cropped back), so its blocks straddle the copy's and the quantisation error
#: is fresh, of the size of the copy's own first pass.
ARMS: dict[str, int | None] = {"copy": None, "q75x2": 0, "q75x2_shift4": 4}
ARM_LABELS = {"copy": "JPEG copy as is", "q75x2": "one more JPEG q75 pass (copy's block grid)",
              "q75x2_shift4": "one more JPEG q75 pass, grid shifted 4 px"}
FULL_EPOCHS, FULL_WARMUP, FULL_MILESTONES = 200, 5, (160, 180)


def jpeg_pass(images: np.ndarray, quality: int = QUALITY, subsampling: int = SUBSAMPLING_420, shift: int = 0,
              progress: bool = False) -> np.ndarray:
    """Each ``uint8`` image of ``images`` ``(N, 3, H, W)`` (channel planes, the CIFAR batches' layout)
    encoded as JPEG by PIL at ``quality`` and ``subsampling`` and decoded back to RGB, as ``make_batches.py``
    decodes the copy. Same shape and dtype; deterministic.

    ``shift`` > 0 pads each image by ``shift`` pixels on every side (edge values) before encoding and crops
    them off after decoding, so the JPEG block grid starts ``shift`` pixels off the image's own."""
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected uint8 images (N, 3, H, W), got {images.dtype} {images.shape}")
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    h, w = images.shape[2:]
    out = np.empty_like(images)
    for i in tqdm(range(len(images)), desc="JPEG pass", unit="img", disable=not progress, mininterval=2.0):
        hwc = images[i].transpose(1, 2, 0)
        if shift:
            hwc = np.pad(hwc, ((shift, shift), (shift, shift), (0, 0)), mode="edge")
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(hwc)).save(buf, format="JPEG", quality=int(quality),
                                                        subsampling=int(subsampling))
        buf.seek(0)
        dec = np.asarray(Image.open(buf).convert("RGB"))
        out[i] = dec[shift:shift + h, shift:shift + w].transpose(2, 0, 1)
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of ``b`` against ``a`` (``uint8``, peak 255) over all their pixels (one pooled MSE)."""
    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0 ** 2 / mse)


def psnr_per_image(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """PSNR in dB of each image of ``b`` against ``a`` (``(N, ...)``; ``inf`` where identical)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    mse = (d ** 2).reshape(len(d), -1).mean(1)
    with np.errstate(divide="ignore"):
        return np.asarray(10.0 * np.log10(255.0 ** 2 / mse))


def _atomic_pickle(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(obj, f, protocol=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_second_pass(src_root: str | Path, out_root: str | Path, quality: int = QUALITY,
                      subsampling: int = SUBSAMPLING_420, shift: int = 0) -> dict[str, Any]:
    """Write ``out_root/cifar-10-batches-py``: every image of the batches under ``src_root`` after one more
    :func:`jpeg_pass` (labels, file names, batch order kept), then the marker
    :data:`~cifar_baselines.data.JPEG_TWICE_MARKER` holding what was done and the PSNR against the source.

    Idempotent: a folder that already holds the marker is left alone and its record returned. Each file is
    written atomically and the marker last, so an interrupted call leaves no marked, half-written folder.
    """
    src = find_batches_dir(src_root)
    out = Path(out_root) / "cifar-10-batches-py"
    marker = out / JPEG_TWICE_MARKER
    if marker.is_file():
        return dict(json.loads(marker.read_text()))
    out.mkdir(parents=True, exist_ok=True)
    sq = {"train": 0.0, "test": 0.0}
    n_px = {"train": 0, "test": 0}
    per_image: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    for name in BATCH_FILES:
        with open(src / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        x = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        print(f"[jpeg_bound] {name}: {len(x)} images", file=sys.stderr, flush=True)
        y = jpeg_pass(x, quality, subsampling, shift=shift, progress=True)
        split = "test" if name == "test_batch" else "train"
        sq[split] += float(((x.astype(np.float64) - y) ** 2).sum())
        n_px[split] += x.size
        per_image[split].append(psnr_per_image(x, y))
        _atomic_pickle({**batch, b"data": y.reshape(len(y), -1)}, out / name)
    meta = src / "batches.meta"
    if meta.is_file():
        with open(meta, "rb") as f:
            _atomic_pickle(pickle.load(f, encoding="bytes"), out / "batches.meta")
    record: dict[str, Any] = {"source": str(src), "source_copy": data_copy(src), "quality": int(quality),
                              "subsampling": "4:2:0" if subsampling == SUBSAMPLING_420 else int(subsampling),
                              "grid_shift_px": int(shift),
                              "encoder": f"PIL {Image.__version__}" if hasattr(Image, "__version__") else "PIL"}
    for split in ("train", "test"):
        pi = np.concatenate(per_image[split])
        record[f"psnr_{split}_db"] = round(10.0 * np.log10(255.0 ** 2 * n_px[split] / sq[split]), 3)
        record[f"psnr_{split}_per_image_median_db"] = round(float(np.median(pi[np.isfinite(pi)])), 3)
        record[f"unchanged_{split}_images"] = int((~np.isfinite(pi)).sum())
    sq_all, n_all = sq["train"] + sq["test"], n_px["train"] + n_px["test"]
    record["psnr_all_db"] = round(10.0 * np.log10(255.0 ** 2 * n_all / sq_all), 3)
    marker.write_text(json.dumps(record, indent=1) + "\n")
    return record


def prepare(root: Path) -> dict[str, dict[str, Any]]:
    """The data folders: ``<root>/data/copy`` (the shared copy, converted once) and one per extra pass."""
    copy_dir = prepare_data_dir(root / "data" / "copy")
    records = {}
    for arm, shift in ARMS.items():
        if shift is not None:
            records[arm] = write_second_pass(copy_dir, root / "data" / arm, shift=shift)
            if data_copy(root / "data" / arm) != COPY_JPEG_TWICE:
                raise SystemExit(f"{root / 'data' / arm} is not recognised as {COPY_JPEG_TWICE!r}")
    return records


def schedule(epochs: int) -> dict[str, Any]:
    """The bundle's schedule scaled to ``epochs``: warm-up 5/200 (at least 1), milestones 160/200 and 180/200."""
    if epochs >= FULL_EPOCHS:
        return {"epochs": FULL_EPOCHS, "warmup_epochs": FULL_WARMUP, "lr_milestones": list(FULL_MILESTONES)}
    ms = [max(1, round(epochs * m / FULL_EPOCHS)) for m in FULL_MILESTONES]
    if ms[1] <= ms[0]:
        ms[1] = ms[0] + 1
    return {"epochs": int(epochs), "warmup_epochs": max(1, round(epochs * FULL_WARMUP / FULL_EPOCHS)),
            "lr_milestones": ms}


def run_name(arm: str, epochs: int) -> str:
    return f"jpeg_bound_{arm}_e{epochs}"


def lean_handlers() -> list[dict[str, Any]]:
    """The bundle's stage-1 training handlers without ``EpochSelection`` (the per-epoch test scoring that keeps
    the best-val / best-test weights): it never touches an RNG, so the last epoch, the result, is unchanged,
    and it costs as much as the training pass at one thread (26 s of 84 s an epoch)."""
    base = json.loads(Path(BUNDLE).read_text())
    return [h for h in base["train"]["handlers"] if not h["_target_"].endswith(".EpochSelection")]


def arm_command(root: Path, arm: str, epochs: int, lean: bool = True) -> list[str]:
    """The command that trains one arm: the bundle as shipped but for the schedule, its data folder, the store;
    ``lean``: validation only at the last epoch and no per-epoch test scoring (:func:`lean_handlers`)."""
    s = schedule(epochs)
    cmd = [sys.executable, "-m", "cifar_baselines", BUNDLE, "--epochs", str(s["epochs"]),
           "--warmup_epochs", str(s["warmup_epochs"]), "--lr_milestones", json.dumps(s["lr_milestones"]),
           "--seed", "0", "--data_dir", str(root / "data" / arm), "--output_dir", str(root),
           "--run_name", run_name(arm, epochs)]
    if lean:
        cmd += ["--settings#val_interval", str(s["epochs"]),
                "--train#handlers", json.dumps(lean_handlers(), separators=(",", ":"))]
    return cmd


def _client(root: Path) -> MlflowClient:
    return MlflowClient(default_tracking_uri(root))


def finished_run(root: Path, arm: str, epochs: int) -> str | None:
    """The id of the arm's finished stage-1 run in ``<root>/mlflow.db``, or ``None``."""
    if not (root / "mlflow.db").is_file():
        return None
    client = _client(root)
    exp = client.get_experiment_by_name("cifar10lt")
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id],
                              f"tags.mlflow.runName = '{run_name(arm, epochs)}' and tags.`lungcal.stage2` = 'none' "
                              "and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"])
    return runs[0].info.run_id if runs else None


def run_arms(root: Path, epochs: int, arms: list[str] | None = None) -> None:
    """Train ``arms`` (default: all, in :data:`ARMS`' order) one after the other; a finished arm is skipped,
    an interrupted one resumes."""
    for arm in arms or list(ARMS):
        if (rid := finished_run(root, arm, epochs)) is not None:
            print(f"[jpeg_bound] {arm}: finished run {rid}, skipped", flush=True)
            continue
        cmd = arm_command(root, arm, epochs)
        print("[jpeg_bound] " + shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)


def test_predictions(root: Path, run_id: str) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """``(probs (N, 10), labels (N,), params)`` of a stage-1 run's logged test predictions."""
    client = _client(root)
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run_id, "predictions/test_predictions.npz", tmp)
        with np.load(path) as z:
            probs, labels = np.asarray(z["probs"], dtype=np.float64), np.asarray(z["labels"], dtype=np.int64)
    return probs, labels, dict(client.get_run(run_id).data.params)


def paired_table(probs: dict[str, np.ndarray], labels: np.ndarray, n_bootstrap: int = 1000, n_bins: int = 15,
                 seed: int = 0) -> str:
    """The markdown table: ACC, ECE (95% CIs) and mean confidence per arm, then each arm − the copy, paired
    (both models scored on the same test images, resampled jointly)."""
    def cell(r: dict[str, Any], k: str) -> str:
        return f"{100 * r[k]:.2f} [{100 * r[f'{k}_ci_low']:.2f}, {100 * r[f'{k}_ci_high']:.2f}]"

    lines = [f"| arm ({len(labels)} test images) | test ACC % | ECE % (15 bins) | mean confidence % |",
             "|---|---|---|---|"]
    for arm, p in probs.items():
        r = calibration_report(p, labels, n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed)
        lines.append(f"| {ARM_LABELS.get(arm, arm)} | {cell(r, 'acc')} | {cell(r, 'ece')} | "
                     f"{100 * r['mean_confidence']:.2f} |")
    for arm in (a for a in probs if a != "copy"):
        diffs = []
        for m in ("acc", "ece"):
            d = paired_bootstrap_diff(m, probs[arm], probs["copy"], labels, n_bootstrap=n_bootstrap, seed=seed,
                                      n_bins=n_bins)
            diffs.append(f"{100 * d['diff']:+.2f} [{100 * d['ci_low']:+.2f}, {100 * d['ci_high']:+.2f}]"
                         + ("" if d["significant"] else " n.s."))
        conf = 100 * (probs[arm].max(1).mean() - probs["copy"].max(1).mean())
        lines.append(f"| {ARM_LABELS.get(arm, arm)} − copy as is, paired | {diffs[0]} pp | {diffs[1]} pp | "
                     f"{conf:+.2f} pp |")
    return "\n".join(lines)


def table(root: Path, epochs: int, n_bootstrap: int, save: Path | None, arms: list[str] | None = None) -> str:
    """The paired table of the finished ``arms`` (default: all; the copy as is among them)."""
    arms = arms or list(ARMS)
    if "copy" not in arms:
        raise SystemExit("the table pairs every arm against 'copy': name it among --arms")
    ids = {arm: finished_run(root, arm, epochs) for arm in arms}
    missing = [a for a, r in ids.items() if r is None]
    if missing:
        raise SystemExit(f"no finished run for {', '.join(missing)} at {epochs} epochs in {root}/mlflow.db")
    probs, labels, params = {}, {}, {}
    for arm, rid in ids.items():
        assert rid is not None
        probs[arm], labels[arm], params[arm] = test_predictions(root, rid)
    if not all(np.array_equal(labels["copy"], lab) for lab in labels.values()):
        raise SystemExit("the two runs did not score the same test images in the same order")
    y = labels["copy"]
    out = [f"schedule: {json.dumps(schedule(epochs))}, seed 0, {BUNDLE}"]
    for arm, rid in ids.items():
        p = params[arm]
        out.append(f"{arm}: run {rid}, data_copy = {p.get('data_copy')!r}, test pixels {p.get('test_pixels_sha256')},"
                   f" train pixels {p.get('train_pixels_sha256')}, train_precision {p.get('train_precision')}")
    for arm in (a for a in arms if a != "copy"):
        record = json.loads((find_batches_dir(root / "data" / arm) / JPEG_TWICE_MARKER).read_text())
        out.append(f"PSNR of {arm} against the copy: {record['psnr_all_db']:.2f} dB over all 60,000 images "
                   f"(train {record['psnr_train_db']:.2f}, test {record['psnr_test_db']:.2f}; per-image median "
                   f"train {record['psnr_train_per_image_median_db']:.2f}, test "
                   f"{record['psnr_test_per_image_median_db']:.2f}; images unchanged: "
                   f"{record['unchanged_train_images'] + record['unchanged_test_images']})")
    out += ["", paired_table(probs, y, n_bootstrap=n_bootstrap)]
    if save is not None:
        save.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, np.ndarray] = {"labels": y.astype(np.int8), "arms": np.array(arms),
                                         "run_ids": np.array([ids[a] for a in arms])}
        arrays.update({f"probs_{arm}": p.astype(np.float32) for arm, p in probs.items()})
        np.savez_compressed(save, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
        out.append(f"\nsaved {save}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=("prepare", "commands", "run", "table", "all"))
    ap.add_argument("--root", type=Path, default=Path("runs/jpeg_bound"))
    ap.add_argument("--epochs", type=int, default=FULL_EPOCHS, help="the common schedule (milestones scaled)")
    ap.add_argument("--n-bootstrap", type=int, default=1000)
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=None,
                    help="run / table these arms, in this order (default: all)")
    ap.add_argument("--save", type=Path, default=None, help="table: write both arms' test predictions (.npz)")
    args = ap.parse_args(argv)
    root = args.root
    if args.step in ("prepare", "run", "all"):
        print(json.dumps(prepare(root), indent=1), flush=True)
    if args.step == "commands":
        for arm in ARMS:
            print(shlex.join(arm_command(root, arm, args.epochs)))
    if args.step in ("run", "all"):
        run_arms(root, args.epochs, args.arms)
    if args.step in ("table", "all"):
        print(table(root, args.epochs, args.n_bootstrap, args.save, args.arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
