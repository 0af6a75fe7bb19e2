"""KVCMAS: query-aware selective recompute of reused segments, stored as compact corrections."""
from .config import KVCMASConfig
from .method import KVCMAS

__all__ = ["KVCMAS", "KVCMASConfig"]
