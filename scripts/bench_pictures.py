"""Benchmark: the per-CT picture of ``lungcal predict`` against building the CT's bag.

For each CT: ``load``: :func:`lungcal.ct.io.load_ct` (what the picture reads); ``bag``:
:func:`lungcal.candidates.cache.compute_bag` with the CT bundles' bag parameters (2.5 mm, K=8,
P=16: preprocessing, lung mask, detector, patches; what scoring costs per CT before the network);
``picture``: :func:`lungcal.ctapp.evaluate.pictures.case_figure` on the loaded CT with the bag's three
first candidates, saved as PNG. Printed: seconds (best of ``--repeat``), the picture's cost as a
ratio to the bag's, and the PNG's size.

CTs: the real LIDC-IDRI-0001 scan in ``../shared/data/ct`` (512x512x133, when present) and a
synthetic demo-cohort phantom (128x128x96 at 2.5 mm, DICOM).

Usage: ``python scripts/bench_pictures.py [--repeat 2] [--threads 1]``
"""
from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

import torch

from lungcal.candidates.cache import compute_bag
from lungcal.ct.io import load_ct
from lungcal.ctapp.evaluate.pictures import case_figure
from lungcal.data.synthetic import make_cohort

SHARED_CT = Path(__file__).resolve().parents[2] / "shared" / "data" / "ct" / "LIDC-IDRI-0001" / "ct.nii.gz"
BAG_PARAMS = {"spacing": [2.5, 2.5, 2.5], "k": 8, "patch_size": 16}


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _case(bag) -> dict:
    n = min(3, len(bag["score"]))
    cands = [{"rank": i + 1, "attention": 1.0 / max(n, 1), "ras_mm": [float(v) for v in bag["world"][i]],
              "radius_mm": float(bag["radius_mm"][i])} for i in range(n)]
    return {"pseudonym": "ct0000", "probability": 0.42, "calibrator": "ts", "candidates": cands,
            "uncertainty": {"interval": None},
            "referral": {"refer": True, "confidence": 0.58, "threshold": 0.62, "rule": "benchmark"}}


def bench(name: str, path: Path, repeat: int) -> None:
    t_load, image = _best(lambda: load_ct(path), repeat)
    t_bag, bag = _best(lambda: compute_bag(path, BAG_PARAMS), repeat)
    case = _case(bag)

    def picture() -> int:
        buf = io.BytesIO()
        fig = case_figure(image, case)
        fig.savefig(buf, format="png", dpi=fig.dpi)
        return buf.tell()

    t_pic, size = _best(picture, repeat)
    shape = "x".join(str(s) for s in image.shape[1:])
    print(f"{name:<16} {shape:<12} load {t_load:6.2f} s   bag {t_bag:6.2f} s   picture {t_pic:6.2f} s   "
          f"picture / bag {t_pic / t_bag:5.2f}x   PNG {size / 1024:.0f} KiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if SHARED_CT.is_file():
        bench("LIDC-IDRI-0001", SHARED_CT, args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        datalist = Path(make_cohort(tmp, n_subjects=2, prevalence=0.5, seed=0, shape=(128, 128, 96),
                                    spacing=(2.5, 2.5, 2.5), formats=("dicom",), progress=False))
        bench("demo phantom", sorted((datalist.parent / "dicom").iterdir())[0], args.repeat)


if __name__ == "__main__":
    main()
