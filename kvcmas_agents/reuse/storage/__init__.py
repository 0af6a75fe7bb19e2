"""Correction storage: low-rank factors, quantized rows and their packed codes, and ``StorageSpec``."""
from .lowrank import Format, LowRankDelta, compress, compress_joint
from .spec import StorageSpec

__all__ = ["Format", "LowRankDelta", "StorageSpec", "compress", "compress_joint"]
