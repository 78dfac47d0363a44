"""Nodule candidates: detection, FROC/CPM evaluation, bag extraction and the bag cache.

See docs/architecture.md (``lungcal.candidates``).
"""
from lungcal.candidates.bags import extract_bag, extract_patches
from lungcal.candidates.cache import CACHE_VERSION, BagCache, BagParams, build_bags, compute_bag, hash_source, load_bag
from lungcal.candidates.detector import Candidates, Detector, LoGBlobDetector, voxel_to_world, world_to_voxel
from lungcal.candidates.detector_config import KeyedDetector, detector_config, detector_from_config
from lungcal.candidates.froc import LUNA16_FP_RATES, cpm, froc_curve, match_candidates

__all__ = [
    "Candidates", "Detector", "LoGBlobDetector", "voxel_to_world", "world_to_voxel",
    "KeyedDetector", "detector_config", "detector_from_config",
    "LUNA16_FP_RATES", "cpm", "froc_curve", "match_candidates",
    "extract_bag", "extract_patches",
    "CACHE_VERSION", "BagCache", "BagParams", "build_bags", "compute_bag", "hash_source", "load_bag",
]
