"""Thin wrapper: ``python benchmark/bench_swa_memory.py ...`` == ``python -m sgl_jax.bench_swa_memory``."""

from sgl_jax.bench_swa_memory import main

if __name__ == "__main__":
    main()
