"""CIFAR-10 and CIFAR-10-LT data: official pickle layout, long-tailed subset, splits (:func:`load_splits`).

Everything is held as one ``uint8`` tensor ``(N, 3, 32, 32)`` plus ``int64`` labels, so a whole
split fits in memory (150 MB for CIFAR-10) and, on CUDA, on the GPU. Batches are sampled and
augmented as whole tensors by :mod:`cifar_baselines.batches`.

Splits (never the test set for model selection or temperature fitting):

- ``cifar10``: 5,000 training images (500 per class, seeded) are held out as the validation split;
  the model trains on the other 45,000.
- ``cifar10lt``: the LDAM/MiSLAS long-tailed subset (:func:`cifar10_lt_counts`, seeded selection
  per class) trains the model; the validation split is a balanced set (500 per class by default)
  of training images that the LT subset does not use. Because the profile would use all 5,000
  images of the head class, the validation images are drawn first, so the head class trains on
  5,000 - ``val_per_class`` images (4,500) while classes 1-9 keep their exact profile counts.

MiSLAS picked its reported epoch on the test set. We do not: the last epoch is reported, and the
validation split alone fits temperature scaling.
"""
from __future__ import annotations

import hashlib
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from monai.apps import download_and_extract

from lungcal.errors import ConfigError, DataError
from lungcal.paths import default_output_dir
from lungcal.runtime import resolve_device
from lungcal.runtime.distributed import rank_zero_first

__all__ = [
    "CIFAR10_CLASSES", "CIFAR10_URL", "CIFAR10_MD5", "CIFAR_MEAN", "CIFAR_STD", "SHARED_MAKE_BATCHES",
    "DATASETS", "CifarSplits", "default_data_dir", "find_batches_dir", "download_cifar10", "load_cifar10",
    "cifar10_lt_counts", "lt_indices", "balanced_indices", "make_splits", "prepare_data_dir", "load_splits",
    "OFFICIAL_MD5", "COPY_OFFICIAL", "COPY_JPEG", "COPY_JPEG_TWICE", "COPY_UNVERIFIED", "JPEG_TWICE_MARKER",
    "data_copy", "pixel_hash",
]

DATASETS = ("cifar10", "cifar10lt")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
# the JPEG copy of CIFAR-10 that ships beside the project checkout (see its README)
SHARED_MAKE_BATCHES = Path("..") / "shared" / "data" / "cifar10" / "make_batches.py"
_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_TEST_FILES = ("test_batch",)
#: md5 of each file of the official archive's ``cifar-10-batches-py`` (as torchvision checks them)
OFFICIAL_MD5 = {
    "data_batch_1": "c99cafc152244af753f735de768cd75f", "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751", "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb", "test_batch": "40351d587109b95175f43aff81a1287e",
}
#: the names of the copies a run can have trained on (the ``data_copy`` param of every CIFAR run)
COPY_OFFICIAL = "official archive (md5 verified)"
COPY_JPEG = "JPEG re-encoded copy of the shared data folder (quality 75, 4:2:0, about 30 dB PSNR)"
COPY_UNVERIFIED = "unverified copy (not the official archive's files)"
#: the JPEG copy re-encoded once more the same way (a control that bounds what the copy's JPEG pass does)
COPY_JPEG_TWICE = "JPEG copy re-encoded once more (quality 75, 4:2:0): two JPEG passes from the original"
#: written into a folder converted from the shared JPEG copy, so later runs can name it
_JPEG_MARKER = "SOURCE_JPEG_COPY"
#: written into a folder whose images are the JPEG copy's re-encoded once more (experiments/jpeg_bound.py)
JPEG_TWICE_MARKER = "SOURCE_JPEG_COPY_SECOND_PASS"


def default_data_dir(output_dir: str | Path | None = None) -> Path:
    """``<output_dir>/data/cifar10``; ``output_dir`` defaults to ``$LUNGCAL_HOME`` or ``./runs``."""
    return (Path(output_dir) if output_dir else default_output_dir()) / "data" / "cifar10"


def _fill_hint(root: Path) -> str:
    hint = (f"download the official archive with download=True (bundle key 'download': true) when a "
            f"network is available, or extract {CIFAR10_URL} into {root}")
    shared = SHARED_MAKE_BATCHES
    if shared.is_file():
        hint = f"run `python {shared} {root}` to convert the bundled JPEG copy, or " + hint
    else:
        hint = (f"run `python ../shared/data/cifar10/make_batches.py {root}` if you have the shared JPEG copy, or "
                + hint)
    return hint


def find_batches_dir(root: str | Path) -> Path:
    """Return the ``cifar-10-batches-py`` folder under (or equal to) ``root``.

    Raises:
        DataError: the folder or one of its files is missing, naming the folder and how to fill it.
    """
    root = Path(root)
    for cand in (root / "cifar-10-batches-py", root):
        if (cand / "batches.meta").is_file() or (cand / "test_batch").is_file():
            missing = [f for f in _TRAIN_FILES + _TEST_FILES if not (cand / f).is_file()]
            if missing:
                raise DataError(f"CIFAR-10 folder is incomplete, missing {', '.join(missing)}",
                                file=cand, fix=_fill_hint(root))
            return cand
    raise DataError("no CIFAR-10 data (expected a 'cifar-10-batches-py' folder with data_batch_1..5 "
                    "and test_batch)", file=root, field="data_dir", fix=_fill_hint(root))


def download_cifar10(root: str | Path) -> Path:
    """Download and extract the official archive into ``root``, checked by md5 (needs a network)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    archive = root / "cifar-10-python.tar.gz"
    try:
        download_and_extract(CIFAR10_URL, filepath=archive, output_dir=root, hash_val=CIFAR10_MD5,
                             hash_type="md5")
    except Exception as exc:  # network down, bad hash...
        raise DataError(f"could not download CIFAR-10 ({exc})", file=root, field="download",
                        fix=_fill_hint(root)) from exc
    return find_batches_dir(root)


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        data = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except Exception as exc:
        raise DataError(f"unreadable CIFAR batch ({exc})", file=path,
                        fix="re-create the folder from the official archive or make_batches.py") from exc
    if len(data) != len(labels):
        raise DataError(f"{len(data)} images but {len(labels)} labels", file=path, fix="re-create the file")
    return data, labels


def load_cifar10(root: str | Path, split: str = "train", download: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Read the official ``cifar-10-batches-py`` pickles.

    Args:
        root: folder holding ``cifar-10-batches-py`` (or that folder itself).
        split: ``"train"`` (50,000 images) or ``"test"`` (10,000).
        download: fetch the official archive (md5-checked) when the folder is missing. Never
            implicit: offline use raises a :class:`DataError` that says how to fill the folder.

    Returns:
        ``(images uint8 (N, 3, 32, 32), labels int64 (N,))``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    try:
        folder = find_batches_dir(root)
    except DataError:
        if not download:
            raise
        folder = download_cifar10(root)
    parts = [_read_batch(folder / f) for f in (_TRAIN_FILES if split == "train" else _TEST_FILES)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def cifar10_lt_counts(imb_factor: float = 0.01, n_max: int = 5000, num_classes: int = 10) -> list[int]:
    """Per-class image counts of CIFAR-10-LT (LDAM/MiSLAS exponential profile).

    ``int(n_max * imb_factor ** (i / (num_classes - 1)))``: ``[5000, 2997, ..., 50]`` and 12,406
    images at ``imb_factor=0.01``.
    """
    if not 0 < imb_factor <= 1:
        raise ValueError(f"imb_factor must be in (0, 1], got {imb_factor}")
    return [int(n_max * imb_factor ** (i / (num_classes - 1))) for i in range(num_classes)]


def _per_class_perm(labels: np.ndarray, num_classes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def lt_indices(labels: np.ndarray, counts: list[int], seed: int = 0) -> np.ndarray:
    """Seeded long-tailed selection: ``counts[c]`` random images of class ``c`` (sorted indices)."""
    perms = _per_class_perm(np.asarray(labels), len(counts), seed)
    for c, (p, n) in enumerate(zip(perms, counts)):
        if len(p) < n:
            raise DataError(f"class {c} has {len(p)} images, the LT profile asks for {n}", field="imb_factor",
                            fix="use the full CIFAR-10 training set or a smaller profile")
    return np.sort(np.concatenate([p[:n] for p, n in zip(perms, counts)]))


def balanced_indices(labels: np.ndarray, per_class: int, exclude: np.ndarray | None = None,
                     num_classes: int = 10, seed: int = 0) -> np.ndarray:
    """Seeded balanced draw of ``per_class`` images per class, avoiding indices in ``exclude``."""
    labels = np.asarray(labels)
    allowed = np.ones(len(labels), dtype=bool)
    if exclude is not None:
        allowed[exclude] = False
    rng = np.random.default_rng(seed)
    out = []
    for c in range(num_classes):
        pool = np.flatnonzero((labels == c) & allowed)
        if len(pool) < per_class:
            raise DataError(f"class {c} has only {len(pool)} images left for a validation split of "
                            f"{per_class} per class", field="val_per_class", fix="lower val_per_class")
        out.append(rng.choice(pool, per_class, replace=False))
    return np.sort(np.concatenate(out))


@dataclass
class CifarSplits:
    """Train / val / test tensors (``uint8`` images, ``int64`` labels) and the training class counts."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_counts: list[int] = field(default_factory=list)
    fingerprint: str = ""
    #: which copy of CIFAR-10 the pixels come from (:func:`data_copy`)
    copy: str = ""

    def to(self, device: str | torch.device) -> CifarSplits:
        """Move every tensor (e.g. to a GPU, so batches never cross the bus)."""
        kw = {k: getattr(self, k).to(device) for k in ("train_x", "train_y", "val_x", "val_y", "test_x", "test_y")}
        return CifarSplits(**kw, class_counts=self.class_counts, fingerprint=self.fingerprint, copy=self.copy)

    def provenance(self) -> dict[str, str]:
        """The MLflow params that say which pixels a run saw: the copy's name and a hash of the training and
        test pixels (a run on other pixels, e.g. the official archive against the JPEG copy, differs)."""
        return {"data_copy": self.copy, "train_pixels_sha256": pixel_hash(self.train_x),
                "test_pixels_sha256": pixel_hash(self.test_x)}


def _subset(idx: np.ndarray, labels: np.ndarray, n: int | None, seed: int) -> np.ndarray:
    """Stratified seeded subset of ``idx`` with about ``n`` items (keeps class proportions)."""
    if n is None or n >= len(idx):
        return idx
    rng = np.random.default_rng(seed + 7)
    keep = np.zeros(len(idx), dtype=bool)
    lab = labels[idx]
    for c in np.unique(lab):
        pos = np.flatnonzero(lab == c)
        k = max(1, int(round(n * len(pos) / len(idx))))
        keep[rng.choice(pos, min(k, len(pos)), replace=False)] = True
    return idx[keep]


def prepare_data_dir(data_dir: str | Path, download: bool = False, convert_shared: bool = True) -> Path:
    """Make sure ``data_dir`` holds ``cifar-10-batches-py``; return the folder to read.

    When it is missing and ``../shared/data/cifar10/make_batches.py`` exists (the JPEG copy shipped
    beside the checkout), it is converted automatically into ``data_dir`` (about a minute, said on
    stderr). Otherwise the official archive is downloaded only if ``download``; else a
    :class:`DataError` names the folder and how to fill it.
    """
    data_dir = Path(data_dir)
    try:
        return find_batches_dir(data_dir)
    except DataError:
        if convert_shared and SHARED_MAKE_BATCHES.is_file():
            print(f"[cifar] {data_dir} has no CIFAR-10 yet: converting the shared copy with "
                  f"`python {SHARED_MAKE_BATCHES} {data_dir}` (about a minute)...", file=sys.stderr, flush=True)
            data_dir.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, str(SHARED_MAKE_BATCHES), str(data_dir)], check=True)
            folder = find_batches_dir(data_dir)
            (folder / _JPEG_MARKER).write_text(f"converted by {SHARED_MAKE_BATCHES}\n")
            return folder
        if not download:
            raise
    return download_cifar10(data_dir)


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def data_copy(data_dir: str | Path) -> str:
    """Which copy of CIFAR-10 ``data_dir`` holds: :data:`COPY_OFFICIAL` when every file's md5 is the official
    archive's, :data:`COPY_JPEG` when the folder was converted from the shared JPEG copy (by
    :func:`prepare_data_dir`, or by ``make_batches.py``, whose files carry their JPEG names),
    :data:`COPY_JPEG_TWICE` when it holds :data:`JPEG_TWICE_MARKER` (the copy re-encoded once more; its files
    keep the JPEG names, so the marker is read first), else :data:`COPY_UNVERIFIED`."""
    folder = find_batches_dir(data_dir)
    if all(_md5(folder / name) == md5 for name, md5 in OFFICIAL_MD5.items()):
        return COPY_OFFICIAL
    if (folder / JPEG_TWICE_MARKER).is_file():
        return COPY_JPEG_TWICE
    if (folder / _JPEG_MARKER).is_file():
        return COPY_JPEG
    with open(folder / "test_batch", "rb") as f:
        names = pickle.load(f, encoding="bytes").get(b"filenames", [])
    if names and bytes(names[0]).endswith(b".jpg"):  # make_batches.py keeps the JPEG tree's file names
        return COPY_JPEG
    return COPY_UNVERIFIED


def pixel_hash(images: torch.Tensor | np.ndarray) -> str:
    """The first 16 hex digits of the SHA-256 of a ``uint8`` image tensor's bytes (its pixels, in order)."""
    a = images.cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def make_splits(data_dir: str | Path, dataset: str = "cifar10", imb_factor: float = 0.01,
                val_per_class: int = 500, seed: int = 0, subset: int | None = None,
                download: bool = False) -> CifarSplits:
    """Build the train/val/test splits of ``dataset`` (``"cifar10"`` or ``"cifar10lt"``).

    Args:
        data_dir: folder with ``cifar-10-batches-py``.
        dataset: ``"cifar10"`` (45,000 train / 5,000 val) or ``"cifar10lt"`` (LT train, balanced
            val from the left-out training images).
        imb_factor: LT imbalance (n_min / n_max), only for ``cifar10lt``.
        val_per_class: validation images per class.
        seed: fixes the LT selection and the validation draw.
        subset: if given, keep a stratified ~``subset`` images of each split (quick runs, tests).
        download: see :func:`load_cifar10`.
    """
    if dataset not in ("cifar10", "cifar10lt"):
        raise DataError(f"unknown dataset {dataset!r}", field="dataset", fix="use 'cifar10' or 'cifar10lt'")
    xtr, ytr = load_cifar10(data_dir, "train", download=download)
    xte, yte = load_cifar10(data_dir, "test")
    if dataset == "cifar10":
        val = balanced_indices(ytr, val_per_class, seed=seed)
        train = np.setdiff1d(np.arange(len(ytr)), val)
    else:
        # the balanced validation split comes out of the training pool first; the LT profile then
        # draws from what is left. Classes 1-9 keep their exact LDAM/MiSLAS counts; the head class,
        # whose profile would use every image, keeps 5000 - val_per_class (see docs/cifar.md).
        val = balanced_indices(ytr, val_per_class, seed=seed + 1)
        rest = np.setdiff1d(np.arange(len(ytr)), val)
        n_max = int(np.bincount(ytr, minlength=10).max())
        avail = np.bincount(ytr[rest], minlength=10)
        counts = [min(n, int(a)) for n, a in zip(cifar10_lt_counts(imb_factor, n_max=n_max), avail)]
        train = rest[lt_indices(ytr[rest], counts, seed=seed)]
    test = np.arange(len(yte))
    train, val, test = (_subset(train, ytr, subset, seed), _subset(val, ytr, subset, seed),
                        _subset(test, yte, subset, seed))
    counts = np.bincount(ytr[train], minlength=10).tolist()
    h = hashlib.sha1()
    for a in (train, val, test):
        h.update(np.ascontiguousarray(a).tobytes())
    t = torch.from_numpy
    return CifarSplits(t(xtr[train]), t(ytr[train]), t(xtr[val]), t(ytr[val]), t(xte[test]), t(yte[test]),
                       class_counts=counts, fingerprint=h.hexdigest()[:12], copy=data_copy(data_dir))


def load_splits(dataset: str, *, data_dir: str | Path | None = None, output_dir: str | Path | None = None,
                download: bool = False, imb_factor: float = 0.01, val_per_class: int = 500, seed: int = 0,
                subset: int | None = None, device: str | torch.device | None = "cpu") -> CifarSplits:
    """The bundles' ``data`` object: :func:`make_splits` from a checked folder, moved to ``device``.

    ``data_dir`` ``None`` means :func:`default_data_dir` of ``output_dir``; an empty folder is
    filled by :func:`prepare_data_dir`. ``device`` goes through :func:`lungcal.runtime.resolve_device`
    (``"auto"``: CUDA when there is one), so batches never cross the bus.

    Raises:
        ConfigError: unknown ``dataset`` or a ``subset`` below 10.
        DataError: no readable CIFAR-10 in ``data_dir``.
    """
    if dataset not in DATASETS:
        raise ConfigError(f"unknown dataset {dataset!r}", field="dataset", fix=f"use one of {', '.join(DATASETS)}")
    if subset is not None and int(subset) < 10:
        raise ConfigError(f"subset={subset} is too small", field="subset", fix="use >= 10 or null")
    with rank_zero_first():  # under torchrun rank 0 fills an empty folder while the other ranks wait
        folder = prepare_data_dir(data_dir or default_data_dir(output_dir), download=download)
    splits = make_splits(folder, dataset, imb_factor=imb_factor, val_per_class=int(val_per_class), seed=int(seed),
                         subset=None if subset is None else int(subset))
    return splits.to(resolve_device(device))
