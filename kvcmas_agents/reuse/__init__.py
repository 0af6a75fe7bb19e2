"""Reuse methods: how a request gets KV it need not compute. ``base.ReuseMethod`` is the seam the
engine calls; every method registers itself by name, and importing this package registers them all."""
from . import exact                       # "none", "prefix"
from .cross_agent import NaiveReuse       # "naive"
from .kvcmas import KVCMAS, KVCMASConfig  # "kvcmas"
from .baselines import CacheBlend, CacheBlendConfig, KVComm, KVCommConfig   # "cacheblend", "kvcomm"
from .base import ReuseContext, ReuseMethod, ReuseRequest
from .options import ReuseOptions
from .registry import method_class, names, register
from .storage import StorageSpec

__all__ = ["KVCMAS", "CacheBlend", "CacheBlendConfig", "KVCMASConfig", "KVComm", "KVCommConfig", "NaiveReuse",
           "ReuseContext", "ReuseMethod", "ReuseOptions", "ReuseRequest", "StorageSpec", "exact", "method_class",
           "names", "register"]
