"""Thin wrapper: ``python benchmark/bench_serving.py ...`` == ``python -m sgl_jax.bench_serving ...``."""

from sgl_jax.bench_serving import main

if __name__ == "__main__":
    main()
