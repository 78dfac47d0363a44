"""Random access to one array of a bag cache entry, without loading the entry.

A cache entry (:mod:`lungcal.candidates.cache`) is written by ``np.savez``: a zip archive whose
members are *stored*, not compressed, so each array's bytes lie contiguously at a fixed offset of
the file. :func:`member_layout` finds that offset, the dtype and the shape (from the zip's local
header and the ``.npy`` header: a few hundred bytes read, the bag itself is not), and
:func:`read_member` reads exactly those bytes into a fresh array (one positioned read; a memory
map of the same bytes measured slower).

So an entry *is* a memory-mappable file per bag: streaming needs no second copy of the cache,
no conversion step and no change of the entry format (hence no cache-version bump; caches built
before stream as they are). A compressed member (an entry someone rewrote with
``np.savez_compressed``) has no such offset: :func:`member_layout` refuses it with a
:class:`~lungcal.errors.CacheError` naming the fix.
"""
from __future__ import annotations

import json
import math
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lungcal.errors import CacheError

__all__ = ["MemberLayout", "member_layout", "read_member", "entry_meta", "MISSING_FIX"]

#: what to do when an entry is gone at training time
MISSING_FIX = ("build the cache first: `lungcal build-bags DATALIST --params BUNDLE` (the same bundle and "
               "output_dir as training), or run training with stream_bags false, which builds missing entries")

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile's structFileHeader (30 bytes)
_LOCAL_MAGIC = b"PK\003\004"  # zipfile's stringFileHeader (not in its public API)


@dataclass(frozen=True)
class MemberLayout:
    """Where one array of an uncompressed ``.npz`` lies: byte ``offset``, ``dtype`` and ``shape`` (C order)."""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def member_layout(path: str | os.PathLike, names: tuple[str, ...]) -> dict[str, MemberLayout]:
    """The :class:`MemberLayout` of arrays ``names`` (without ``.npy``) of the ``.npz`` at ``path``.

    Raises:
        CacheError: the file is missing, not a zip, lacks a member, or a member is compressed or
            Fortran-ordered (no single contiguous block to map).
    """
    out = {}
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as fh:
            infos = {i.filename: i for i in zf.infolist()}
            for name in names:
                info = infos.get(f"{name}.npy")
                if info is None:
                    raise CacheError(f"bag cache entry lacks {name!r}", file=path, fix="delete the file; it is rebuilt")
                if info.compress_type != zipfile.ZIP_STORED:
                    raise CacheError(f"bag cache entry member {name!r} is compressed and cannot be memory-mapped",
                                     file=path, fix="delete the file; it is rebuilt uncompressed")
                fh.seek(info.header_offset)
                header = _LOCAL_HEADER.unpack(fh.read(_LOCAL_HEADER.size))
                if header[0] != _LOCAL_MAGIC:
                    raise CacheError("bag cache entry has a bad zip header", file=path, fix="delete the file")
                fh.seek(info.header_offset + _LOCAL_HEADER.size + header[10] + header[11])  # name, extra lengths
                version = np.lib.format.read_magic(fh)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read_header(fh)
                if fortran and len(shape) > 1:
                    raise CacheError(f"bag cache entry member {name!r} is Fortran-ordered", file=path,
                                     fix="delete the file; it is rebuilt")
                if dtype.hasobject:
                    raise CacheError(f"bag cache entry member {name!r} holds objects", file=path,
                                     fix="delete the file; it is rebuilt")
                out[name] = MemberLayout(fh.tell(), dtype.str, tuple(int(s) for s in shape))
    except FileNotFoundError as e:
        raise CacheError("bag cache entry is missing", file=path, fix=MISSING_FIX) from e
    except (OSError, ValueError, EOFError, struct.error, zipfile.BadZipFile) as e:
        raise CacheError(f"unreadable bag cache entry ({e})", file=path,
                         fix="delete the file; it is rebuilt on the next run") from e
    return out


def read_member(path: str | os.PathLike, layout: MemberLayout) -> np.ndarray:
    """The array at ``layout`` in ``path``, read with one positioned read into a new array.

    Nothing stays open or mapped between items, so a reader's RSS does not grow with the entries
    it has read. (``np.memmap`` of the same bytes gives the same array; it measured about 3x slower
    per 128 KiB bag, page faults plus map/unmap: ``scripts/bench_bags.py``.)
    """
    out = np.empty(layout.shape, dtype=np.dtype(layout.dtype))
    try:
        with open(path, "rb", buffering=0) as fh:
            fh.seek(layout.offset)
            n = fh.readinto(out.data.cast("B"))  # out is C-contiguous: its buffer, as bytes
    except FileNotFoundError as e:
        raise CacheError("bag cache entry is missing", file=path, fix=MISSING_FIX) from e
    except OSError as e:
        raise CacheError(f"unreadable bag cache entry ({e})", file=path,
                         fix="delete the file; it is rebuilt on the next run") from e
    if n != layout.nbytes:  # shorter than its layout: truncated or replaced by another entry
        raise CacheError(f"bag cache entry is truncated ({n} of {layout.nbytes} bytes)", file=path,
                         fix="delete the file; it is rebuilt on the next run")
    return out


def entry_meta(path: str | os.PathLike) -> dict:
    """The ``meta`` JSON of an entry (version and parameters), reading only that member."""
    try:
        with zipfile.ZipFile(path) as zf, zf.open("meta.npy") as fh:
            return json.loads(str(np.lib.format.read_array(fh, allow_pickle=False)))
    except FileNotFoundError as e:
        raise CacheError("bag cache entry is missing", file=Path(path), fix=MISSING_FIX) from e
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise CacheError(f"unreadable bag cache entry ({e})", file=path,
                         fix="delete the file; it is rebuilt on the next run") from e
