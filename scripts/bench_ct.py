"""Benchmark: CT preprocessing (load -> lung mask -> crop to the lungs) vs a bare SimpleITK load,
and the whole per-CT bag path at the full-resolution preset vs the default one.

A 512x512x260 synthetic chest phantom (0.7 x 0.7 x 1.25 mm, a thin-slice screening CT; ``--shape``,
``--spacing``) is written once as a DICOM series and as a NIfTI file, or ``--image`` names a real CT.
Each task runs in a fresh process (so peak RSS is per task).

Stage ``io`` (per format):

* ``sitk``: ``SimpleITK`` reads the same file(s) into a numpy array (the baseline);
* ``preprocess``: ``lungcal.ct.transforms.preprocess_ct(path, spacing=None)`` (load to RAS HU
  float32, lung mask, crop, HU window); and with ``spacing=1.0`` (adds the resampling).

Printed: seconds (best of ``--repeat`` after a warm-up), the time ratio to the bare load (goal
<= 5x), and the peak RSS growth over the process's post-import RSS, as a multiple of the float32
volume size (goal <= 4x).

Stage ``path`` (per format): what ``lungcal.candidates.cache.compute_bag`` does for one CT, step by
step (load -> preprocess: lung mask, crop, resample, HU window -> candidates: the LoG detector ->
bag: K patches), at

* ``default``: the CT bundles' bag settings and detector (bundles/nlst_focal.json: 2.5 mm, K = 16, P = 16,
  LesionDetector);
* ``fullres_solid``: those with the overrides of bundles/fullres.json (1 mm, K = 16, P = 32) and the
  detector's solid channel alone (the LoG search at LesionDetector's solid radii);
* ``fullres``: the full-resolution bag with the bundles' detector (what the default bag needs).

Each path's wall time is also given over a bare SimpleITK read of the same input, measured in the same
run (issue 43 item 6's goals: at most 6x with the solid channel, 8x with the bundles' detector).

Printed per step: wall seconds (best of ``--repeat`` after a warm-up) and, for the whole path, the
process CPU seconds (user + sys: what the path costs when the cores are shared; the load average
is printed too), the peak RSS growth over the post-import RSS as a multiple of the float32 volume,
and both as ratios to the default path. Goals (issue 17): fullres <= 15 s per CT on 2 cores, peak
RSS growth <= 4x the float32 volume.

Stage ``mask``: the lung masker alone (:class:`lungcal.ct.masking.LungMasker`, on the loaded HU volume, in this
process) as shipped and with its rolling ball in the axial slices only (``lesion_closing_sideways_mm=0``, the
default before 2026-12-08: the baseline), on the test volume and on a 128x128x96 phantom at 2.5 mm (the demo
cohort's CTs, which the first run masks a thousand of). Printed: seconds (best of ``--repeat``) and the ratio.

Usage: ``python scripts/bench_ct.py [--workdir DIR] [--repeat 2] [--threads 2] [--stages io,path,mask]
[--formats dicom,nifti] [--image CT]`` (``--image``: the path stage on that CT instead of the phantom)
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

from lungcal.candidates.bags import extract_bag
from lungcal.candidates.cache import BagParams
from lungcal.candidates.lesions import SOLID_PYRAMID_SIGMA_VOX, SOLID_RADII_MM
from lungcal.ct.io import load_ct
from lungcal.ct.masking import LungMasker
from lungcal.ct.transforms import build_preprocess, preprocess_ct
from lungcal.data.synthetic import (
    Nodule,
    ScannerProfile,
    _write_nifti,
    fake_identifiers,
    make_phantom,
    write_dicom_series,
)

#: the phantom's grid: a thin-slice screening chest CT (1.25 mm slices, 0.7 mm pixels; --shape, --spacing)
SHAPE = (512, 512, 260)
SPACING = (0.7, 0.7, 1.25)
BUNDLES = Path(__file__).resolve().parent.parent / "bundles"
BAG_KEYS = ("spacing", "hu_window", "k", "patch_size")


#: the presets of the path stage: the bundles' bag (with bundles/fullres.json's overrides for the fullres
#: ones), with the bundles' detector, or (``*_solid``) its solid channel alone
PATH_PRESETS = ("default", "fullres_solid", "fullres")


def bundle_detector(cfg: dict) -> dict:
    """The bundle's ``detector`` section as a detector config (its ``@hu_window`` resolved)."""
    det = {k: v for k, v in cfg["detector"].items() if not k.startswith("_desc")}
    return {k: (cfg["hu_window"] if v == "@hu_window" else v) for k, v in det.items()}


def bag_params(preset: str) -> BagParams:
    """The bag settings of bundles/nlst_focal.json, with bundles/fullres.json's overrides for ``fullres*``;
    the bundle's detector, or for ``*_solid`` the solid LoG channel of LesionDetector alone."""
    cfg = json.loads((BUNDLES / "nlst_focal.json").read_text())
    if preset.startswith("fullres"):
        cfg.update(json.loads((BUNDLES / "fullres.json").read_text()))
    solid = {"radii_mm": list(SOLID_RADII_MM), "pyramid_sigma_vox": SOLID_PYRAMID_SIGMA_VOX}
    detector = solid if preset.endswith("_solid") else bundle_detector(cfg)
    return BagParams(**{k: tuple(cfg[k]) if isinstance(cfg[k], list) else cfg[k] for k in BAG_KEYS},
                     detector=detector)


def _rss_mb() -> float:
    """This process's peak RSS (VmHWM). Not ``ru_maxrss``: across fork + exec Linux carries the parent's
    high-water mark into it, so a parent that had just rendered the phantom inflated every task's peak."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # not Linux: KiB, the best there is


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _path_steps(path: str, params: BagParams) -> dict:
    """compute_bag's steps for one CT, timed one by one."""
    kwargs = params.preprocess_kwargs()
    spacing, window, margin = kwargs.pop("spacing"), kwargs.pop("hu_window"), kwargs.pop("margin_mm")
    t = {}
    c0, t0 = _cpu_s(), time.perf_counter()
    img = load_ct(path)
    t["load"] = time.perf_counter() - t0
    t["native_mb"] = img.numel() * 4 / 2**20
    t1 = time.perf_counter()
    out = build_preprocess(spacing, window, margin, load=False, **kwargs)({"image": img})
    del img
    t["preprocess"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    image, lung = out["image"], out["lung_mask"]
    del out
    lung = lung > 0  # as compute_bag does
    affine = np.asarray(image.affine, np.float64)
    cands = params.make_detector().detect(image, lung, np.linalg.norm(affine[:3, :3], axis=0), affine)
    del lung
    t["candidates"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    bag, _ = extract_bag(image, cands.top(params.k).voxel, params.k, params.patch_size)
    t["bag"] = time.perf_counter() - t1
    t["total"] = time.perf_counter() - t0
    t["cpu"] = _cpu_s() - c0
    t["shape"] = list(image.shape[1:]) + [f"bag {tuple(bag.shape)}"]
    return t


def _child(task: str, fmt: str, path: str, repeat: int, threads: int) -> dict:

    torch.set_num_threads(threads)
    sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(threads)

    base = _current_rss_mb()
    if task.startswith("path_"):
        params = bag_params(task[len("path_"):])
        runs = [_path_steps(path, params) for _ in range(repeat + 1)]  # the first warms up
        best = min(runs[1:] or runs, key=lambda r: r["total"])
        return {"task": task, "format": fmt, **best, "peak_rss_mb": _rss_mb(), "base_rss_mb": base,
                "loadavg": os.getloadavg()[0]}

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


def _make_inputs(workdir: Path, formats: tuple[str, ...] = ("dicom", "nifti"), shape=SHAPE, spacing=SPACING) -> dict:
    grid = "x".join(str(int(n)) for n in shape) + "_" + "x".join(f"{s:g}" for s in spacing)
    paths = {"dicom": workdir / f"dicom_{grid}", "nifti": workdir / f"ct_{grid}.nii.gz"}
    if not all(paths[f].exists() for f in formats):
        rng = np.random.default_rng(0)
        nods = [Nodule((60.0, 10.0, 20.0), 12.0, True, "spiculated", "solid")]
        hu, origin, _ = make_phantom(rng, shape, spacing, nods, ScannerProfile(noise_hu=25, kernel_sigma_mm=0.5))
        if "dicom" in formats and not paths["dicom"].is_dir():
            write_dicom_series(hu, origin, spacing, paths["dicom"], fake_identifiers(rng), rng)
        if "nifti" in formats and not paths["nifti"].is_file():
            _write_nifti(hu, origin, spacing, paths["nifti"])
    return {f: str(paths[f]) for f in formats}


def _bench_mask(inputs: dict[str, str], repeat: int) -> None:
    """Stage ``mask`` (module docstring)."""
    vols = {"demo phantom": (make_phantom(np.random.default_rng(5), (128, 128, 96), (2.5, 2.5, 2.5), (),
                                          ScannerProfile(noise_hu=15))[0], np.array([2.5, 2.5, 2.5]))}
    for name, path in inputs.items():
        img = load_ct(path)
        vols[name] = (np.asarray(img[0]), np.linalg.norm(np.asarray(img.affine, np.float64)[:3, :3], axis=0))
        break  # one format is enough: the masker sees the same volume
    print(f"\n{'volume':<14} {'grid':>16} {'axial only s':>12} {'shipped s':>10} {'x axial':>8}")
    for name, (hu, sp) in vols.items():
        secs = {}
        for label, masker in (("axial", LungMasker(lesion_closing_sideways_mm=0.0)), ("shipped", LungMasker())):
            masker(hu, sp)  # warm-up
            times = []
            for _ in range(max(repeat, 1)):
                t = time.perf_counter()
                masker(hu, sp)
                times.append(time.perf_counter() - t)
            secs[label] = min(times)
        print(f"{name:<14} {str(hu.shape):>16} {secs['axial']:12.3f} {secs['shipped']:10.3f} "
              f"{secs['shipped'] / secs['axial']:8.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None, help="where the test volume is written (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stages", default="io,path", help="io (load and preprocess vs SimpleITK), path (the bag path), "
                    "mask (the lung masker alone)")
    ap.add_argument("--formats", default="dicom,nifti")
    ap.add_argument("--image", default=None, help="both stages on this CT (a file or DICOM folder), not the phantom")
    ap.add_argument("--shape", default=",".join(map(str, SHAPE)), help="the phantom's voxels X,Y,Z")
    ap.add_argument("--spacing", default=",".join(map(str, SPACING)), help="the phantom's voxel size in mm")
    ap.add_argument("--child", nargs=3, metavar=("TASK", "FORMAT", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child, repeat=args.repeat, threads=args.threads)))
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_ct_"))
    workdir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    shape = tuple(int(v) for v in args.shape.split(","))
    spacing = tuple(float(v) for v in args.spacing.split(","))
    if args.image:
        inputs = {"image": args.image}
        img = sitk.ReadImage(args.image) if Path(args.image).is_file() else None
        shape = img.GetSize() if img is not None else shape
        spacing = img.GetSpacing() if img is not None else spacing
    else:
        inputs = _make_inputs(workdir, tuple(args.formats.split(",")), shape, spacing)
    stages = args.stages.split(",")
    print(f"test volume {tuple(shape)} at {tuple(round(s, 3) for s in spacing)} mm ready in "
          f"{time.perf_counter() - t:.1f} s ({workdir if not args.image else args.image})")
    vol_mb = shape[0] * shape[1] * shape[2] * 4 / 2**20

    def run(task, fmt, path):
        out = subprocess.run([sys.executable, __file__, "--repeat", str(args.repeat), "--threads",
                              str(args.threads), "--child", task, fmt, path],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    print(f"\nfloat32 volume: {vol_mb:.0f} MiB; threads={args.threads}; best of {args.repeat}")
    if "mask" in stages:
        _bench_mask(inputs, args.repeat)
    if "io" in stages:
        results = {(fmt, task): run(task, fmt, path) for fmt, path in inputs.items()
                   for task in ("sitk", "preprocess", "preprocess_1mm")}
        print(f"{'format':<7} {'task':<15} {'seconds':>8} {'x sitk':>7} {'peak RSS growth':>16} {'x vol':>6}  output")
        for (fmt, task), r in results.items():
            ratio = r["seconds"] / results[(fmt, "sitk")]["seconds"]
            growth = r["peak_rss_mb"] - r["base_rss_mb"]
            print(f"{fmt:<7} {task:<15} {r['seconds']:8.2f} {ratio:7.2f} {growth:13.0f} MiB {growth / vol_mb:6.2f}  "
                  f"{tuple(r['out_shape'])}")
        print("goals (issue 35): preprocessing at 1 mm (the fullres preset's grid) <= 6x the bare SimpleITK load; "
              "peak RSS growth <= 4x the float32 volume")
    if "path" in stages:
        for preset in PATH_PRESETS:
            p = bag_params(preset)
            det = p.detector.get("_target_", "LoGBlobDetector").rpartition(".")[2]
            print(f"{preset}: spacing {p.spacing} mm, HU window {p.hu_window}, K = {p.k}, P = {p.patch_size}, "
                  f"detector {det} {json.dumps({k: v for k, v in p.detector.items() if k != '_target_'})}")
        print("\nper-CT path (load -> preprocess -> candidates -> bag), wall seconds per step; x read: the path's "
              "wall time over a bare SimpleITK read of the same file(s), measured in the same run")
        head = (f"{'format':<7} {'preset':<13} {'load':>6} {'prep':>6} {'cands':>6} {'bag':>5} {'total':>6} "
                f"{'x read':>6} {'x def':>6} {'CPU s':>6} {'peak RSS growth':>16} {'x vol':>6} {'x def':>6} "
                f"{'load avg':>8}  grid")
        print(head)
        for fmt, path in inputs.items():
            bare = run("sitk", fmt, path)["seconds"]
            res = {preset: run(f"path_{preset}", fmt, path) for preset in PATH_PRESETS}
            d_growth = res["default"]["peak_rss_mb"] - res["default"]["base_rss_mb"]
            if args.image:
                print(f"(--image: x vol is against its own float32 volume, {res['default']['native_mb']:.0f} MiB)")
            for preset, r in res.items():
                growth = r["peak_rss_mb"] - r["base_rss_mb"]
                vol_mb = r["native_mb"]
                print(f"{fmt:<7} {preset:<13} {r['load']:6.2f} {r['preprocess']:6.2f} {r['candidates']:6.2f} "
                      f"{r['bag']:5.2f} {r['total']:6.2f} {r['total'] / bare:6.2f} "
                      f"{r['total'] / res['default']['total']:6.2f} "
                      f"{r['cpu']:6.2f} "
                      f"{growth:12.0f} MiB {growth / vol_mb:6.2f} {growth / d_growth:6.2f} {r['loadavg']:8.1f}  "
                      f"{tuple(r['shape'])}")
            print(f"{fmt:<7} bare SimpleITK read {bare:.2f} s")
        print("goals (fullres): <= 15 s per CT on 2 cores; peak RSS growth <= 4x the float32 volume; the whole path "
              "<= 6x a bare read with the solid channel (fullres_solid) and <= 8x with the bundles' detector "
              "(fullres; issue 43 item 6)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
