"""KV memory: request slots, the paged allocator, prefix caches (the `BasePrefixCache` contract, one class
per kind), the Req-aware hand-off to them (`cache_manager`) and the one release path (`common`)."""


def create_prefix_cache(server_args, req_to_token_pool, allocator, sliding_window=None):
    """The prefix cache for `server_args`: RadixCache by default, SWARadixCache when `allocator` is a hybrid
    `SWAPagedAllocator` (a sliding-window model with hybrid SWA memory; `sliding_window` is its window in
    tokens), ChunkCache (no sharing, either pool layout) with --disable-radix-cache. All implement
    `base_prefix_cache.BasePrefixCache`.

    Raises:
        ValueError: a hybrid allocator without `sliding_window`.
    """
    from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
    from sgl_jax.srt.mem_cache.radix_cache import RadixCache
    from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator
    from sgl_jax.srt.mem_cache.swa_radix_cache import SWARadixCache

    if server_args.disable_radix_cache:
        return ChunkCache(req_to_token_pool, allocator)
    if isinstance(allocator, SWAPagedAllocator):
        if not sliding_window:
            raise ValueError("a hybrid SWA KV pool needs the model's sliding window")
        return SWARadixCache(req_to_token_pool, allocator, server_args.page_size, sliding_window)
    return RadixCache(req_to_token_pool, allocator, server_args.page_size)
