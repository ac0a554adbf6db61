"""KV memory: request slots, the paged allocators (full, and SWA for hybrid sliding-window memory), the prefix
caches (the `BasePrefixCache` contract, one class per kind, chosen from `registry`), the Req-aware hand-off to
them (`cache_manager`), the one release path (`common.release_kv_cache`), and `kv_memory.KVMemory`, the one
object per DP rank that owns all of it and answers the scheduler's questions about memory."""
