"""Thin wrapper: ``python benchmark/bench_one_batch.py ...`` == ``python -m sgl_jax.bench_one_batch``."""

from sgl_jax.bench_one_batch import main

if __name__ == "__main__":
    main()
