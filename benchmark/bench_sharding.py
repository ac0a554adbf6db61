"""Thin wrapper: ``python benchmark/bench_sharding.py ...`` == ``python -m sgl_jax.bench_sharding``."""

from sgl_jax.bench_sharding import main

if __name__ == "__main__":
    main()
