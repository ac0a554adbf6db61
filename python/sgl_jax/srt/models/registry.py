"""Model classes by the HF ``architectures`` name, derived from the model files as upstream SGLang discovers its
``EntryClass``es: every module of this package that defines ``EntryClass`` (a class or a list of classes)
contributes each class under each name of its ``architectures`` attribute. A class's ``role``, ``is_encoder`` and
``embedding_form_of`` attributes (models/llama.LlamaForCausalLM's docstring) say how it is served, so a new
architecture is one file and nothing here or in configs/ lists it."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Dict, List

from sgl_jax.srt import models as _package


@functools.lru_cache(maxsize=None)
def model_registry() -> Dict[str, type]:
    """HF architecture name -> the NNX model class, from every model module's ``EntryClass`` (imported once).

    Raises:
        RuntimeError: two classes claim one architecture name, or an entry class has no ``architectures``.
    """
    table: Dict[str, type] = {}
    for info in sorted(pkgutil.iter_modules(_package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{_package.__name__}.{info.name}")
        entries = getattr(module, "EntryClass", None)
        if entries is None:
            continue
        for cls in entries if isinstance(entries, (list, tuple)) else [entries]:
            if not cls.architectures:
                raise RuntimeError(f"{module.__name__}.{cls.__name__} is an EntryClass with no architectures")
            for arch in cls.architectures:
                if table.get(arch, cls) is not cls:
                    raise RuntimeError(f"architecture {arch!r} is claimed by both {table[arch].__qualname__} and "
                                       f"{cls.__qualname__}")
                table[arch] = cls
    return table


def supported_architectures() -> List[str]:
    """The HF architecture names this engine serves, sorted."""
    return sorted(model_registry())


def get_model_class(architecture: str, embedding: bool = False) -> type:
    """The NNX class for an HF architecture name; `embedding` (--is-embedding): the class whose
    ``embedding_form_of`` names it (its decoder stack without the LM head: Qwen3-Embedding names the causal class,
    stores no lm_head and does not tie it), where there is one.

    Raises:
        ValueError: an architecture no model file serves; one line naming it and the supported ones.
    """
    table = model_registry()
    if architecture not in table:
        raise ValueError(f"Model architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(supported_architectures())}")
    if embedding:
        for cls in table.values():
            if architecture in cls.embedding_form_of:
                return cls
    return table[architecture]
