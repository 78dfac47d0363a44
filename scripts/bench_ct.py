"""Benchmark: CT preprocessing (load -> lung mask -> crop to the lungs) vs a bare SimpleITK load.

A 512x512x300 synthetic chest phantom (0.7 x 0.7 x 1.0 mm) is written once as a DICOM series and as
a NIfTI file. For each format, in a fresh process each (so peak RSS is per task):

* ``sitk``: ``SimpleITK`` reads the same file(s) into a numpy array (the baseline);
* ``preprocess``: ``lungcal.ct.transforms.preprocess_ct(path, spacing=None)`` (load to RAS HU
  float32, lung mask, crop, HU window); and with ``spacing=1.0`` (adds the resampling).

Printed: seconds (best of ``--repeat`` after a warm-up), the time ratio to the bare load (goal
<= 5x), and the peak RSS growth over the process's post-import RSS, as a multiple of the float32
volume size (goal <= 4x).

Usage: ``python scripts/bench_ct.py [--workdir DIR] [--repeat 2] [--threads 2]``
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import SimpleITK as sitk
import torch

from lungcal.ct.transforms import preprocess_ct
from lungcal.data.synthetic import (
    Nodule,
    ScannerProfile,
    _write_nifti,
    fake_identifiers,
    make_phantom,
    write_dicom_series,
)

SHAPE = (512, 512, 300)
SPACING = (0.7, 0.7, 1.0)


def _rss_mb() -> float:

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _child(task: str, fmt: str, path: str, repeat: int, threads: int) -> dict:

    torch.set_num_threads(threads)
    sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(threads)

    base = _current_rss_mb()

    def run():
        if task == "sitk":
            if fmt == "dicom":
                r = sitk.ImageSeriesReader()
                r.SetFileNames(sitk.ImageSeriesReader.GetGDCMSeriesFileNames(path))
                img = r.Execute()
            else:
                img = sitk.ReadImage(path)
            return sitk.GetArrayFromImage(img).shape
        spacing = None if task == "preprocess" else 1.0
        out = preprocess_ct(path, spacing=spacing)
        return tuple(out["image"].shape)

    times = []
    shape = None
    for _ in range(repeat + 1):  # the first run warms the page cache and imports
        t = time.perf_counter()
        shape = run()
        times.append(time.perf_counter() - t)
    return {"task": task, "format": fmt, "seconds": min(times[1:]), "peak_rss_mb": _rss_mb(), "base_rss_mb": base,
            "out_shape": list(shape)}


def _make_inputs(workdir: Path) -> dict:


    dcm, nii = workdir / "dicom", workdir / "ct.nii.gz"
    if not (dcm.is_dir() and nii.is_file()):
        rng = np.random.default_rng(0)
        nods = [Nodule((60.0, 10.0, 20.0), 12.0, True, "spiculated", "solid")]
        hu, origin, _ = make_phantom(rng, SHAPE, SPACING, nods, ScannerProfile(noise_hu=25, kernel_sigma_mm=0.5))
        write_dicom_series(hu, origin, SPACING, dcm, fake_identifiers(rng), rng)
        _write_nifti(hu, origin, SPACING, nii)
    return {"dicom": str(dcm), "nifti": str(nii)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None, help="where the test volume is written (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("TASK", "FORMAT", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child, repeat=args.repeat, threads=args.threads)))
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_ct_"))
    workdir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    inputs = _make_inputs(workdir)
    print(f"test volume {SHAPE} at {SPACING} mm ready in {time.perf_counter() - t:.1f} s ({workdir})")
    vol_mb = SHAPE[0] * SHAPE[1] * SHAPE[2] * 4 / 2**20
    results = {}
    for fmt, path in inputs.items():
        for task in ("sitk", "preprocess", "preprocess_1mm"):
            out = subprocess.run([sys.executable, __file__, "--repeat", str(args.repeat), "--threads",
                                  str(args.threads), "--child", task, fmt, path],
                                 capture_output=True, text=True, check=True)
            results[(fmt, task)] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nfloat32 volume: {vol_mb:.0f} MiB; threads={args.threads}; best of {args.repeat}")
    print(f"{'format':<7} {'task':<15} {'seconds':>8} {'x sitk':>7} {'peak RSS growth':>16} {'x vol':>6}  output")
    for (fmt, task), r in results.items():
        ratio = r["seconds"] / results[(fmt, "sitk")]["seconds"]
        growth = r["peak_rss_mb"] - r["base_rss_mb"]
        print(f"{fmt:<7} {task:<15} {r['seconds']:8.2f} {ratio:7.2f} {growth:13.0f} MiB {growth / vol_mb:6.2f}  "
              f"{tuple(r['out_shape'])}")
    print("\ngoals: preprocess time <= 5x the bare SimpleITK load; peak RSS growth <= 4x the float32 volume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
