"""KV cache bookkeeping: the block pool and per-request block tables (pure Python, no torch)."""

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.kv_cache_manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager"]
