"""KV memory: the paged block store, the per-agent exact prefix cache, and the packing of home views'
partial blocks."""
from .kv_store import KVStore, OutOfBlocksError
from .prefix_cache import PrefixCache

__all__ = ["KVStore", "OutOfBlocksError", "PrefixCache"]
