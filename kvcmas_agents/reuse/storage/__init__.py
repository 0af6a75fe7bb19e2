"""Correction storage: low-rank factors, quantized rows and their packed codes, and ``StorageSpec``."""
from .codec import Format, compress, compress_joint
from .delta import DeltaSide, LowRankDelta
from .spec import StorageSpec

__all__ = ["DeltaSide", "Format", "LowRankDelta", "StorageSpec", "compress", "compress_joint"]
