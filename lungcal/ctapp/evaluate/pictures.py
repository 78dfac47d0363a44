"""One picture per scored CT, for a clinician to check at a glance, and the gallery a run logs.

:func:`case_figure` draws, from the CT in HU (as :func:`lungcal.ct.io.load_ct` returns it: RAS,
native grid) and the case record of :mod:`lungcal.ctapp.infer.scoring`:

- the calibrated probability of cancer on a 0-1 bar, with its uncertainty interval when the model
  gave one (MC samples), the referral band (probabilities whose confidence is below the referral
  threshold) and the verdict: referred for review or not; with a site's guaranteed decision threshold
  (the record's ``decision``), a mark at the threshold on the bar and a line: work-up or not, and what
  the threshold guarantees;
- a lung overview: the coronal slice through the most attended candidate, every shown candidate
  marked by its number (hollow when it lies in another slice);
- the three most attended candidates, one row each: axial, coronal and sagittal patches
  (``patch_mm`` wide, lung window) centred on the candidate, with its attention and its position
  in mm (patient coordinates: R/L, A/P, S/I).
- above the panels: a red band OUTSIDE THE MODEL'S TRAINING DATA with what lies outside (the record's
  ``out_of_distribution``; such a CT is referred, and the verdict says why), and on the right the record's
  ``notice`` (a demo model: "demo model trained on synthetic phantoms: not a clinical estimate").

Display follows radiology: axial and coronal views have the patient's right on the image's left;
axial has anterior up; coronal and sagittal have superior up; sagittal has anterior on the left.
Pixels are drawn at their physical aspect. Figures use :class:`matplotlib.figure.Figure` with the
Agg canvas (no ``pyplot`` state). Nothing here writes a path or an identifier: the title is the
pseudonym.
"""
from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import patheffects
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Ellipse, Rectangle
from tqdm.auto import tqdm

from lungcal.ct.io import load_ct
from lungcal.ctapp.evaluate.cases import OOD_REASON, ReferralRule, case_record, ood_summary, position_text
from lungcal.errors import ConfigError
from lungcal.paths import atomic_write

__all__ = ["LUNG_WINDOW", "CANDIDATE_COLOURS", "PICTURE_MODES", "case_figure", "write_case_picture",
           "gallery_selection", "check_picture_mode", "write_pictures", "log_split_pictures"]

#: ``test_pictures`` of the stage-1 bundles: which CTs of the test split get a picture
PICTURE_MODES = ("gallery", "all", "none")

#: display window in HU (level -600, width 1500)
LUNG_WINDOW = (-1350.0, 150.0)
#: one colour per candidate rank (1, 2, 3), used in the overview and on the patches
CANDIDATE_COLOURS = ("#e6194b", "#f58231", "#42d4f4")
_VIEWS = ("axial", "coronal", "sagittal")
_INTERP = "bilinear"
_STROKE = [patheffects.withStroke(linewidth=2.5, foreground="black")]  # labels readable on any grey
_STROKE_THIN = [patheffects.withStroke(linewidth=1.5, foreground="white")]
_LABEL_SIDES = ((1, -1), (1, 1), (-1, -1))  # (right, above), (right, below), (left, above) of the ring
_DECISION_COLOUR = "#2b5fad"
_OOD_COLOUR = "#b2182b"
_NOTICE_COLOUR = "#762a83"


# ----------------------------------------------------------------------------- geometry
def _volume(image) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(array (X, Y, Z) float32 HU, affine 4x4, spacing (3,))`` of a MetaTensor or ``(array, affine)``."""
    if isinstance(image, tuple):
        arr, affine = image
    else:
        arr, affine = image, image.affine
    arr = np.asarray(arr.detach().cpu().numpy() if hasattr(arr, "detach") else arr, dtype=np.float32)
    if arr.ndim == 4:
        arr = arr[0]
    affine = np.asarray(affine.detach().cpu().numpy() if hasattr(affine, "detach") else affine, dtype=np.float64)
    spacing = np.sqrt((affine[:3, :3] ** 2).sum(axis=0))
    return arr, affine, spacing


def _to_voxel(affine: np.ndarray, ras_mm: Sequence[float]) -> np.ndarray:
    return (np.linalg.inv(affine) @ np.r_[np.asarray(ras_mm, float), 1.0])[:3]


def _plane(arr: np.ndarray, view: str, idx: int) -> np.ndarray:
    """The display image of one plane (rows top to bottom, columns left to right, see the module doc)."""
    if view == "axial":  # rows: anterior (high y) down to posterior; columns: patient right (high x) to left
        return arr[::-1, ::-1, idx].T
    if view == "coronal":  # rows: superior to inferior; columns: patient right to left
        return arr[::-1, idx, ::-1].T
    return arr[idx, ::-1, ::-1].T  # sagittal: rows superior to inferior; columns anterior to posterior


def _plane_axes(view: str) -> tuple[int, int, int]:
    """``(slice axis, row axis, column axis)`` of a view in array axes."""
    return {"axial": (2, 1, 0), "coronal": (1, 2, 0), "sagittal": (0, 2, 1)}[view]


def _display_rc(shape: Sequence[int], view: str, voxel: np.ndarray) -> tuple[float, float]:
    """``(row, column)`` of a voxel in the display image of :func:`_plane` (every view flips both axes)."""
    _, r_ax, c_ax = _plane_axes(view)
    return shape[r_ax] - 1 - voxel[r_ax], shape[c_ax] - 1 - voxel[c_ax]


def _patch(arr: np.ndarray, view: str, voxel: np.ndarray, half_vox: np.ndarray, fill: float) -> np.ndarray:
    """The ``view`` plane through ``voxel``, cropped to ``+-half_vox`` (voxels per array axis), padded with ``fill``."""
    s_ax, r_ax, c_ax = _plane_axes(view)
    idx = int(np.clip(round(voxel[s_ax]), 0, arr.shape[s_ax] - 1))
    img = _plane(arr, view, idx)
    r0, c0 = _display_rc(arr.shape, view, voxel)
    hr, hc = int(round(half_vox[r_ax])), int(round(half_vox[c_ax]))
    out = np.full((2 * hr + 1, 2 * hc + 1), fill, dtype=np.float32)
    rr, cc = int(round(r0)), int(round(c0))
    rs, re_ = max(rr - hr, 0), min(rr + hr + 1, img.shape[0])
    cs, ce = max(cc - hc, 0), min(cc + hc + 1, img.shape[1])
    if rs < re_ and cs < ce:
        out[rs - (rr - hr):re_ - (rr - hr), cs - (cc - hc):ce - (cc - hc)] = img[rs:re_, cs:ce]
    return out


def _aspect(spacing: np.ndarray, view: str) -> float:
    _, r_ax, c_ax = _plane_axes(view)
    return float(spacing[r_ax] / spacing[c_ax])


def _body_box(img: np.ndarray, margin: int = 4) -> tuple[slice, slice]:
    """Rows and columns of a display image that hold the body (HU > -500), with a margin."""
    body = img > -500
    if not body.any():
        return slice(None), slice(None)
    rows, cols = np.flatnonzero(body.any(axis=1)), np.flatnonzero(body.any(axis=0))
    return (slice(max(rows[0] - margin, 0), rows[-1] + margin + 1),
            slice(max(cols[0] - margin, 0), cols[-1] + margin + 1))


# ----------------------------------------------------------------------------- panels
def _probability_panel(ax, case: Mapping[str, Any]) -> None:
    p = float(case["probability"])
    unc = case.get("uncertainty") or {}
    ref = case.get("referral") or {}
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    head = str(case.get("pseudonym", ""))
    if case.get("label") is not None:  # a labelled split (stage-1 test): the known outcome beside the call
        head += f"   known outcome: {'cancer' if int(case['label']) == 1 else 'no cancer'}"
    ax.text(0.0, 1.0, head, fontsize=13, color="0.35", va="top", transform=ax.transAxes)
    ax.text(0.0, 0.86, f"p(cancer) = {p:.2f}", fontsize=24, fontweight="bold", va="top", transform=ax.transAxes)
    lo, hi = unc.get("interval") or (None, None)
    spread = (f"interval {lo:.2f}-{hi:.2f} ({unc.get('method', 'samples')}, {unc.get('samples', 0)} samples)"
              if lo is not None else "no uncertainty interval: the model gave no MC samples")
    ax.text(0.0, 0.64, f"calibrated ({case.get('calibrator', 'none')}); {spread}", fontsize=9.5, color="0.25",
            va="top", transform=ax.transAxes)
    # the bar: referral band, interval, the probability
    bar = ax.inset_axes((0.01, 0.38, 0.96, 0.15))
    bar.set_xlim(0, 1)
    bar.set_ylim(0, 1)
    bar.set_yticks([])
    bar.set_xticks([0, 0.25, 0.5, 0.75, 1.0])
    bar.tick_params(labelsize=8, length=2, pad=1)
    bar.add_patch(Rectangle((0, 0.25), 1, 0.5, color="0.88", zorder=0))
    t = ref.get("threshold")
    if t is not None and t > 0.5:
        bar.add_patch(Rectangle((1 - t, 0.25), 2 * t - 1, 0.5, color="#fdd49e", zorder=1))
        bar.text(0.5, 0.5, "refer", ha="center", va="center", fontsize=7.5, color="#b35806", zorder=2)
    if lo is not None:
        bar.plot([lo, hi], [0.5, 0.5], color="black", lw=2.5, solid_capstyle="butt", zorder=3)
    bar.plot([p], [0.5], marker="v", markersize=13, color="black", zorder=4, clip_on=False)
    for side in ("top", "right", "left"):
        bar.spines[side].set_visible(False)
    if ref.get("refer") is None:
        verdict, colour = "referral: no threshold (see the rule in the JSON)", "0.35"
    elif ref["refer"] and OOD_REASON in (ref.get("reasons") or []):
        verdict, colour = f"REFER for review: {OOD_REASON}", _OOD_COLOUR
    elif ref["refer"]:
        verdict, colour = f"REFER for review: confidence {ref['confidence']:.3f} < {t:.3f}", "#b35806"
    else:
        verdict, colour = f"not referred: confidence {ref['confidence']:.3f} >= {t:.3f}", "#1a7a3a"
    ax.text(0.0, 0.24, verdict, fontsize=12, fontweight="bold", color=colour, va="top", transform=ax.transAxes)
    decision = case.get("decision")
    rule = ref.get("rule")
    if rule:
        ax.text(0.0, 0.13, textwrap.fill(str(rule), 92 if decision is None else 104), fontsize=8 if decision is None
                else 7, color="0.35", va="top", transform=ax.transAxes)
    if decision is not None:
        _decision_mark(ax, bar, decision)


def _decision_mark(ax, bar, decision: Mapping[str, Any]) -> None:
    """The site's guaranteed threshold on the bar, and the work-up verdict in one small line below the rule."""
    t = float(decision["threshold"])
    bar.plot([t, t], [0.05, 0.95], color=_DECISION_COLOUR, lw=1.8, zorder=5)
    bar.text(t, 1.0, "work-up", ha="left" if t < 0.85 else "right", va="bottom", fontsize=7, color=_DECISION_COLOUR,
             zorder=5)
    verdict = "WORK-UP" if decision["positive"] else "no work-up"
    side = ">=" if decision["positive"] else "<"
    ax.text(0.0, 0.01, f"{verdict}: p {side} {t:.3f} (guaranteed: <= {100 * float(decision['alpha']):g}% "
            f"of cancers missed, {100 * (1 - float(decision['delta'])):g}% confidence)", fontsize=8, fontweight="bold",
            color=_DECISION_COLOUR, va="top", transform=ax.transAxes)


def _banner(fig, case: Mapping[str, Any]) -> None:
    """Above the panels: OUTSIDE THE MODEL'S TRAINING DATA and what (left, red), the demo notice (right)."""
    ood = case.get("out_of_distribution") or {}
    if ood.get("flagged"):
        what = ood_summary(ood, ranges=False)  # the ranges are in the JSON
        fig.text(0.015, 0.995, textwrap.shorten(f"OUTSIDE THE MODEL'S TRAINING DATA: {what}", 95), fontsize=10,
                 fontweight="bold", color="white", va="top", ha="left",
                 bbox={"boxstyle": "square,pad=0.25", "fc": _OOD_COLOUR, "ec": "none"})
    if case.get("notice"):
        fig.text(0.99, 0.995, str(case["notice"]), fontsize=10, fontweight="bold", color=_NOTICE_COLOUR, va="top",
                 ha="right")


def _overview_panel(ax, arr, affine, spacing, candidates) -> None:
    vox = [_to_voxel(affine, c["ras_mm"]) for c in candidates]
    j = int(np.clip(round(vox[0][1]), 0, arr.shape[1] - 1)) if vox else arr.shape[1] // 2
    img = _plane(arr, "coronal", j)
    rows, cols = _body_box(img)
    ax.imshow(img[rows, cols], cmap="gray", vmin=LUNG_WINDOW[0], vmax=LUNG_WINDOW[1],
              aspect=_aspect(spacing, "coronal"), interpolation=_INTERP)
    for k, (c, v) in enumerate(zip(candidates, vox)):
        r, cc = _display_rc(arr.shape, "coronal", v)
        r, cc = r - (rows.start or 0), cc - (cols.start or 0)
        same = abs(v[1] - j) * spacing[1] <= max(float(c.get("radius_mm", 0.0)), spacing[1])
        colour = CANDIDATE_COLOURS[k % len(CANDIDATE_COLOURS)]
        rad = max(float(c.get("radius_mm", 3.0)) * 1.5, 6.0)
        w, h = 2 * rad / spacing[0], 2 * rad / spacing[2]  # columns run along x, rows along z
        ax.add_patch(Ellipse((cc, r), w, h, fill=False, ec=colour, lw=2.2 if same else 1.4, ls="-" if same else "--"))
        sx, sy = _LABEL_SIDES[k % len(_LABEL_SIDES)]  # each rank on its own side: close candidates stay legible
        ax.text(cc + sx * (w / 2 + 2), r + sy * (h / 2 + 1), str(k + 1), color=colour, fontsize=13, fontweight="bold",
                va="bottom" if sy < 0 else "top", ha="left" if sx > 0 else "right", path_effects=_STROKE_THIN)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title("lung overview: coronal slice through #1 (dashed: other slices)", fontsize=9.5)
    for x, y, s, ha, va in ((0.01, 0.5, "R", "left", "center"), (0.99, 0.5, "L", "right", "center"),
                            (0.5, 0.99, "S", "center", "top"), (0.5, 0.01, "I", "center", "bottom")):
        ax.text(x, y, s, transform=ax.transAxes, color="yellow", fontsize=11, fontweight="bold", ha=ha, va=va,
                path_effects=_STROKE)


def _patch_row(axes, arr, affine, spacing, cand: Mapping[str, Any], k: int, patch_mm: float, fill: float) -> None:
    v = _to_voxel(affine, cand["ras_mm"])
    width = max(patch_mm, 5.0 * float(cand.get("radius_mm", 0.0)))  # a large nodule keeps some lung around it
    half = (width / 2.0) / spacing
    colour = CANDIDATE_COLOURS[k % len(CANDIDATE_COLOURS)]
    for ax, view in zip(axes, _VIEWS):
        img = _patch(arr, view, v, half, fill)
        ax.imshow(img, cmap="gray", vmin=LUNG_WINDOW[0], vmax=LUNG_WINDOW[1], aspect=_aspect(spacing, view),
                  interpolation=_INTERP)
        _, r_ax, c_ax = _plane_axes(view)
        rc, cc = (img.shape[0] - 1) / 2.0, (img.shape[1] - 1) / 2.0
        rad = max(float(cand.get("radius_mm", 3.0)) * 1.6, 5.0)
        ax.add_patch(Ellipse((cc, rc), 2 * rad / spacing[c_ax], 2 * rad / spacing[r_ax], fill=False, ec=colour,
                             lw=1.3, ls="--"))
        ax.set_xticks([])
        ax.set_yticks([])
        for s in ax.spines.values():
            s.set_edgecolor(colour)
            s.set_linewidth(2.5)
        ax.text(0.03, 0.97, view, transform=ax.transAxes, color="yellow", fontsize=8.5, va="top", ha="left",
                path_effects=_STROKE)
    axes[1].set_title(f"#{k + 1}   attention {float(cand['attention']):.2f}   {position_text(cand['ras_mm'])}   "
                      f"radius {float(cand.get('radius_mm', 0)):.0f} mm", fontsize=10.5, color=colour,
                      fontweight="bold")


def case_figure(image, case: Mapping[str, Any], *, patch_mm: float = 40.0, n_candidates: int = 3) -> Figure:
    """The picture of one scored CT (see the module doc).

    Args:
        image: the CT in HU: a ``(1, X, Y, Z)`` MetaTensor from :func:`lungcal.ct.io.load_ct`, or
            ``(array (X, Y, Z), affine)`` in RAS.
        case: the case record (:func:`lungcal.ctapp.evaluate.cases.case_record`): ``pseudonym``,
            ``probability``, ``calibrator``, ``uncertainty``, ``referral``, ``candidates`` (each
            with ``ras_mm``, ``radius_mm``, ``attention``; most attended first).
        patch_mm: width of each candidate patch.
        n_candidates: how many candidates get a row of patches.
    """
    arr, affine, spacing = _volume(image)
    fill = float(min(arr.min(), -1000.0))
    cands = list(case.get("candidates") or [])[:n_candidates]
    fig = Figure(figsize=(13.0, 8.2), dpi=100)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(3, 5, width_ratios=[1.05, 1.05, 1, 1, 1], height_ratios=[1, 1, 1],
                          left=0.015, right=0.99, top=0.95, bottom=0.015, wspace=0.04, hspace=0.16)
    _probability_panel(fig.add_subplot(gs[0, 0:2]), case)
    _banner(fig, case)
    _overview_panel(fig.add_subplot(gs[1:3, 0:2]), arr, affine, spacing, cands)
    for k in range(n_candidates):
        axes = [fig.add_subplot(gs[k, 2 + m]) for m in range(3)]
        if k < len(cands):
            _patch_row(axes, arr, affine, spacing, cands[k], k, patch_mm, fill)
        else:
            for ax in axes:
                ax.axis("off")
            axes[1].text(0.5, 0.5, f"no candidate #{k + 1}", ha="center", va="center", fontsize=10, color="0.4",
                         transform=axes[1].transAxes)
    return fig


def write_case_picture(path: str | os.PathLike, image, case: Mapping[str, Any], **kw: Any) -> Path:
    """Draw :func:`case_figure` and write it as a PNG (atomically)."""
    fig = case_figure(image, case, **kw)
    path = Path(path)
    with atomic_write(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=fig.dpi)
    return path


def gallery_selection(cases: Sequence[Mapping[str, Any]], n: int = 3) -> dict[str, list[str]]:
    """The pseudonyms a run's gallery shows: ``highest_probability`` and ``lowest_probability`` (the
    most confident calls each way, not referred), and ``referred`` (least confident first); each
    at most ``n`` cases, a case in one group only."""
    kept = [c for c in cases if not (c.get("referral") or {}).get("refer")]
    referred = sorted((c for c in cases if (c.get("referral") or {}).get("refer")),
                      key=lambda c: (c["referral"]["confidence"], c["pseudonym"]))
    high = sorted(kept, key=lambda c: (-float(c["probability"]), c["pseudonym"]))[:n]
    shown = {c["pseudonym"] for c in high}
    low = [c for c in sorted(kept, key=lambda c: (float(c["probability"]), c["pseudonym"]))
           if c["pseudonym"] not in shown][:n]
    return {"highest_probability": [c["pseudonym"] for c in high],
            "lowest_probability": [c["pseudonym"] for c in low],
            "referred": [c["pseudonym"] for c in referred[:n]]}


def check_picture_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`PICTURE_MODES`, else a ``ConfigError`` naming the fix."""
    if mode not in PICTURE_MODES:
        raise ConfigError(f"test_pictures must be one of {', '.join(PICTURE_MODES)}, got {mode!r}",
                          field="test_pictures", fix="use gallery (the default), all or none")
    return str(mode)


def write_pictures(sources: Sequence[Mapping[str, Any]], cases: Sequence[Mapping[str, Any]],
                   folder: str | os.PathLike, progress: bool = True) -> list[Path]:
    """Read each CT (``sources[i]``: ``image``, optional ``series_uid``) and write ``<folder>/<pseudonym>.png``
    of ``cases[i]``, with a progress bar."""
    folder = Path(folder)
    out = []
    pairs = list(zip(sources, cases))
    for src, case in tqdm(pairs, desc="pictures", unit="CT", disable=not progress or len(pairs) < 2):
        image = load_ct(src["image"], series_uid=src.get("series_uid"))
        out.append(write_case_picture(folder / f"{case['pseudonym']}.png", image, case))
    return out


def log_split_pictures(tracker, split: Mapping[str, Any], probs, attention, *, rule: ReferralRule, calibrator: str,
                       folder: str | os.PathLike, mode: str = "gallery", top_k: int = 3) -> dict[str, list[str]]:
    """Pictures of a labelled split's CTs (a stage-1 run's test split) and its gallery in ``tracker``'s run.

    ``split``: the cohort split (``subjects``, ``labels``, ``candidates``, ``images``); ``probs`` its
    calibrated ``(N, 2)`` probabilities, ``attention`` ``(N, K)``. ``mode`` (bundle key
    ``test_pictures``): ``gallery`` draws only the CTs of :func:`gallery_selection` (at most nine:
    1-3 s each), ``all`` draws every CT into ``folder`` (a 1500-CT test split: 25 minutes to an hour) and
    logs the same gallery, ``none`` draws nothing. Each picture shows the known outcome beside the
    call. The gallery is logged as ``gallery/<group>/<pseudonym>.png``; returns it.
    """
    if check_picture_mode(mode) == "none" or not len(split["subjects"]):
        return {}
    p = np.asarray(probs, dtype=np.float64)
    scores = {"subjects": list(split["subjects"]), "probs": p if p.ndim == 2 else np.stack([1 - p, p], 1),
              "attention": np.asarray(attention), "candidates": split["candidates"], "member_probs": None}
    labels = np.asarray(split["labels"]).reshape(-1)
    cases = [case_record(scores, i, rule, calibrator=calibrator, top_k=top_k, label=int(labels[i]))
             for i in range(len(scores["subjects"]))]
    gallery = gallery_selection(cases)
    index = {c["pseudonym"]: i for i, c in enumerate(cases)}
    wanted = range(len(cases)) if mode == "all" else sorted({index[n] for names in gallery.values() for n in names})
    write_pictures([split["images"][i] for i in wanted], [cases[i] for i in wanted], folder)
    for group, names in gallery.items():
        for name in names:
            tracker.log_artifact(Path(folder) / f"{name}.png", f"gallery/{group}")
    return gallery
