"""Prior methods on the same engine, for the benchmark: CacheBlend and KVCOMM. They plug into the
reuse seam like any method; KVCMAS does not import them."""
from .cacheblend import CacheBlend, CacheBlendConfig
from .kvcomm import KVComm, KVCommConfig

__all__ = ["CacheBlend", "CacheBlendConfig", "KVComm", "KVCommConfig"]
