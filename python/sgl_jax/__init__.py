"""sgl-jax: a JAX-first LLM serving engine (OpenAI-compatible server, offline Engine)."""

from sgl_jax.version import __version__


def __getattr__(name):
    if name == "Engine":
        from sgl_jax.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "__version__"]
