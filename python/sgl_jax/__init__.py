"""sgl-jax: a JAX-first LLM serving engine (OpenAI-compatible server, offline Engine)."""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "Engine":
        from sgl_jax.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "__version__"]
