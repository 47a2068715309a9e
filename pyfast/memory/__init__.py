"""Memory objects that persist across decodes: the KV cache (and, later, recurrent state)."""
from pyfast.memory.kv_cache import KVCache, KVCacheFull

__all__ = ["KVCache", "KVCacheFull"]
