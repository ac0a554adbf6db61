"""KV memory: request slots, the paged allocator, prefix caches and the one release path."""


def create_prefix_cache(server_args, req_to_token_pool, allocator):
    """RadixCache by default; ChunkCache (no sharing) with --disable-radix-cache."""
    from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
    from sgl_jax.srt.mem_cache.radix_cache import RadixCache

    if server_args.disable_radix_cache:
        return ChunkCache(req_to_token_pool, allocator)
    return RadixCache(req_to_token_pool, allocator, server_args.page_size)
