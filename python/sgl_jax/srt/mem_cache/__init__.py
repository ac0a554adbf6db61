"""KV memory: request slots, the paged allocator, prefix caches (the `BasePrefixCache` contract, one class
per kind), the Req-aware hand-off to them (`cache_manager`) and the one release path (`common`)."""


def create_prefix_cache(server_args, req_to_token_pool, allocator):
    """The prefix cache for `server_args`: RadixCache by default; ChunkCache (no sharing) with
    --disable-radix-cache. Both implement `base_prefix_cache.BasePrefixCache`."""
    from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
    from sgl_jax.srt.mem_cache.radix_cache import RadixCache

    if server_args.disable_radix_cache:
        return ChunkCache(req_to_token_pool, allocator)
    return RadixCache(req_to_token_pool, allocator, server_args.page_size)
