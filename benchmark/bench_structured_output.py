"""Thin wrapper: ``python benchmark/bench_structured_output.py ...`` == ``python -m sgl_jax.bench_structured_output``."""

from sgl_jax.bench_structured_output import main

if __name__ == "__main__":
    main()
