"""Memory objects that persist across decodes: the KV cache, recurrent state planes (snapshot
rollback) and the hybrid of both."""
from pyfast.memory.hybrid import HybridMemory, SeqState, plan_ubatches
from pyfast.memory.kv_cache import KVCache, KVCacheFull, KVRows
from pyfast.memory.recurrent import NoFreeSlot, RecurrentGeometry, RecurrentMemory, RecurrentState, RollbackError

__all__ = ["KVCache", "KVCacheFull", "KVRows", "HybridMemory", "SeqState", "plan_ubatches", "NoFreeSlot",
           "RecurrentGeometry", "RecurrentMemory", "RecurrentState", "RollbackError"]
