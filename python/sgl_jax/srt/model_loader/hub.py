"""Models and tokenizers from the Hugging Face hub: ``--model-path org/name`` and ``--tokenizer-path org/name``.

Files are fetched with ``huggingface_hub`` (`snapshot_download`, `hf_hub_download`) into its cache, as SGLang does,
so its settings apply unchanged: ``HF_HOME`` / ``HF_HUB_CACHE`` (or ``--download-dir``) for the cache,
``HF_TOKEN`` for private and gated repositories, ``HF_ENDPOINT`` for a mirror, ``HF_HUB_OFFLINE=1`` to never touch
the network. Only what the engine reads is fetched: config and tokenizer files, the safetensors weights (the shards
of ``*.safetensors.index.json`` when there is one), or a single .gguf file.

The cache is always looked at first (``local_files_only=True``): a model cached once loads without any network
request, so the engine's processes (tokenizer manager, scheduler, detokenizer), which each resolve the model, never
download it twice and never wait on the hub. Only when the cache lacks something, and ``HF_HUB_OFFLINE`` is not
set, is the hub asked. Unlike huggingface_hub's own default, a cached branch (``main``) is therefore not checked
for newer commits; pass ``--revision <commit>`` (or clear the cache) to move to another one. The reason: with no
network and a hub address that does not answer, huggingface_hub's first request has no timeout and blocks for
minutes; a cache hit must not depend on it.

Failures are one-line exceptions naming the repository, the revision and the cache directory searched.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Callable, List, Optional, Sequence, TypeVar

logger = logging.getLogger(__name__)

# (modules.json and the Pooling module's config: a sentence-transformers model's pooling, tokenizer/embedding.py)
CONFIG_PATTERNS = ("config.json", "generation_config.json", "modules.json", "*Pooling/config.json")
TOKENIZER_PATTERNS = ("tokenizer*", "vocab*", "merges*", "special_tokens_map.json", "added_tokens.json",
                      "chat_template*", "*.tiktoken", "spiece.model", "sentencepiece*.model")
SAFETENSORS_INDEX_PATTERN = "*.safetensors.index.json"
REMOTE_CODE_PATTERNS = ("*.py",)  # a model's or tokenizer's own code, fetched with --trust-remote-code

# huggingface_hub's rule for "namespace/name": letters, digits, "-", "_", "."; no "--" or ".."; neither part
# starts with "-" or "." nor ends with one.
_HUB_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?/[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?")

T = TypeVar("T")


def is_hub_id(name: Optional[str]) -> bool:
    """Whether `name` is to be fetched from the hub: an ``org/name`` repository id (the form huggingface_hub
    accepts) that is not an existing local path. Bare names (``gpt2``) are not taken as hub ids: they name installed
    model packages (`default_model.packaged_gguf_for`)."""
    return bool(name) and len(name) <= 96 + 1 + 96 and bool(_HUB_ID.fullmatch(name)) and not os.path.exists(name)


@dataclasses.dataclass(frozen=True)
class HubModel:
    """A hub model in the local cache.

    repo_id, revision: as asked (revision None: the default branch).
    snapshot_dir: the cache's snapshot folder of the resolved commit (config, tokenizer and safetensors files; for a
        GGUF-only repository it may hold nothing but the .gguf, or not exist when the .gguf is in a subfolder).
    gguf_file: local path of the chosen .gguf, None for a safetensors model.
    """

    repo_id: str
    revision: Optional[str]
    snapshot_dir: str
    gguf_file: Optional[str]


class _NotCached(Exception):
    """The cache lacks a file the model needs (the message says which); the hub may have it."""


def hub_cache_dir(cache_dir: Optional[str] = None) -> str:
    """The cache directory huggingface_hub uses: `cache_dir` (``--download-dir``) when given, else ``HF_HUB_CACHE``
    (default ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``)."""
    from huggingface_hub import constants

    return os.path.abspath(os.path.expanduser(cache_dir or constants.HF_HUB_CACHE))


def _offline() -> bool:
    from huggingface_hub import constants

    is_offline = getattr(constants, "is_offline_mode", None)
    return bool(is_offline() if is_offline else constants.HF_HUB_OFFLINE)


def _first_line(err: BaseException) -> str:
    lines = [s.strip() for s in str(err).splitlines() if s.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def _fetch(repo_id: str, revision: Optional[str], cache_dir: Optional[str], what: str,
           fetch: Callable[[bool], T]) -> T:
    """``fetch(local_only)``: first with local_only=True (the cache), then, unless HF_HUB_OFFLINE is set, from the
    hub. Turns huggingface_hub's failures into one-line FileNotFoundErrors naming `what`, the id, the revision
    and the cache directory."""
    from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"hub {what} {repo_id!r} (revision {revision or 'main'!r})"
    cache = hub_cache_dir(cache_dir)
    try:
        return fetch(True)
    except (_NotCached, LocalEntryNotFoundError) as e:
        missing = (f" ({e})" if isinstance(e, _NotCached) else
                   " (its cached snapshot is incomplete)" if type(e).__name__ == "IncompleteSnapshotError" else "")
    if _offline():
        raise FileNotFoundError(f"{where} is neither a local path nor in the cache {cache}{missing}; "
                                "HF_HUB_OFFLINE is set, so it cannot be downloaded") from None
    logger.info("Downloading %s into %s", where, cache)
    try:
        return fetch(False)
    except LocalEntryNotFoundError as e:  # the hub could not be reached (huggingface_hub fell back on the cache)
        reason = _first_line(e.__cause__ or e)
        raise FileNotFoundError(f"{where} is neither a local path nor in the cache {cache}{missing}, and the "
                                f"hub could not be reached ({reason})") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{where}: the hub repository has no such revision (cache {cache})") from None
    except RepositoryNotFoundError as e:  # also gated / private ones without access (HF_TOKEN)
        raise FileNotFoundError(f"{where} is not on the hub or not accessible (private or gated repositories need "
                                f"HF_TOKEN; {_first_line(e)}) (cache {cache})") from None
    except EntryNotFoundError as e:
        raise FileNotFoundError(f"{where}: {_first_line(e)} (cache {cache})") from None
    except (HfHubHTTPError, OSError) as e:  # rate limits, server errors, broken connections, a full disk
        raise FileNotFoundError(f"{where} could not be downloaded into the cache {cache} ({_first_line(e)})") from None


def _local_files(folder: str) -> List[str]:
    """Paths, relative to `folder` with "/" separators, of the files under it (links to files included)."""
    out = []
    for root, _dirs, files in os.walk(folder):
        for name in files:
            out.append(os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/"))
    return sorted(out)


def _repo_files(repo_id: str, commit: str, snapshot_dir: str, local_only: bool) -> List[str]:
    """The repository's files at `commit`: listed by the hub when online, else those in the cached snapshot."""
    if local_only:
        return _local_files(snapshot_dir) if os.path.isdir(snapshot_dir) else []
    from huggingface_hub import HfApi

    return sorted(HfApi().list_repo_files(repo_id, revision=commit))


def _safetensors_weights(snapshot_dir: str, files: Sequence[str]) -> List[str]:
    """The safetensors files the engine loads: the shards named by ``model.safetensors.index.json`` (or another
    top-level index) when there is one, else the top-level ``*.safetensors`` (so that, e.g., a Mistral repository's
    ``consolidated.safetensors`` next to its sharded copy is not fetched twice)."""
    indexes = sorted(f for f in files if "/" not in f and f.endswith(".safetensors.index.json"))
    if indexes:
        index = "model.safetensors.index.json" if "model.safetensors.index.json" in indexes else indexes[0]
        path = os.path.join(snapshot_dir, index)
        if not os.path.exists(path):
            raise _NotCached(f"no {index}")
        with open(path) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return [f for f in files if "/" not in f and f.endswith(".safetensors")]


def _gguf_choice(repo_id: str, files: Sequence[str]) -> Optional[str]:
    """The repository's only .gguf file, None when it has none.

    Raises:
        ValueError: several .gguf files (the message lists them and names --gguf-file).
    """
    ggufs = [f for f in files if f.endswith(".gguf")]
    if len(ggufs) > 1:
        raise ValueError(f"hub model {repo_id!r} holds no safetensors weights but {len(ggufs)} .gguf files; choose "
                         f"one with --gguf-file: {', '.join(ggufs)}")
    return ggufs[0] if ggufs else None


def _patterns(base: Sequence[str], trust_remote_code: bool) -> List[str]:
    return list(base) + (list(REMOTE_CODE_PATTERNS) if trust_remote_code else [])


def _missing_remote_code(snapshot_dir: str) -> List[str]:
    """The ``<module>.py`` files that the ``auto_map`` of config.json / tokenizer_config.json names (transformers'
    remote code) and `snapshot_dir` lacks; references into other repositories (``org/repo--module.Class``) are
    not checked."""
    refs = []
    for name in ("config.json", "tokenizer_config.json"):
        path = os.path.join(snapshot_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                auto_map = json.load(f).get("auto_map") or {}
            for value in (auto_map.values() if isinstance(auto_map, dict) else [auto_map]):
                refs += value if isinstance(value, (list, tuple)) else [value]
    modules = {r.rsplit(".", 1)[0] for r in refs if isinstance(r, str) and "--" not in r and "." in r}
    return sorted(f"{m.replace('.', '/')}.py" for m in modules
                  if not os.path.exists(os.path.join(snapshot_dir, m.replace(".", "/") + ".py")))


def download_model(repo_id: str, revision: Optional[str] = None, cache_dir: Optional[str] = None,
                   gguf_file: Optional[str] = None, trust_remote_code: bool = False) -> HubModel:
    """Fetch what the engine needs of the hub model `repo_id` into huggingface_hub's cache (or find it there)
    and return where it is.

    Args:
        repo_id: ``org/name``.
        revision: a branch, tag or commit hash (``--revision``); None: the default branch ``main``.
        cache_dir: ``--download-dir``; None: huggingface_hub's cache (``HF_HUB_CACHE`` / ``HF_HOME``).
        gguf_file: ``--gguf-file``, the path of a .gguf inside the repository: only that file is fetched.
        trust_remote_code: also fetch the repository's ``*.py`` files (the model's own config/tokenizer code).

    Without `gguf_file`: config, generation config and tokenizer files, plus the safetensors weights (only the
    shards its index names); a repository without safetensors but with exactly one .gguf gets that .gguf instead.
    The cache is searched first; the hub is asked only when something is missing there and ``HF_HUB_OFFLINE`` is
    not set (module docstring).

    Returns:
        HubModel: the local snapshot folder and, for GGUF weights, the local .gguf path.

    Raises:
        FileNotFoundError: not in the cache and HF_HUB_OFFLINE is set or the hub cannot be reached; no such
            repository, revision or file on the hub; a repository with neither safetensors nor .gguf files.
            One line naming the id, the revision and the cache directory.
        ValueError: several .gguf files and no `gguf_file`.
    """
    from huggingface_hub import hf_hub_download, snapshot_download

    if gguf_file:
        def fetch_gguf(local_only: bool) -> HubModel:
            path = hf_hub_download(repo_id, gguf_file, revision=revision, cache_dir=cache_dir,
                                   local_files_only=local_only)
            return HubModel(repo_id, revision, _snapshot_of(path, gguf_file), path)

        return _fetch(repo_id, revision, cache_dir, "model", fetch_gguf)

    def fetch(local_only: bool) -> HubModel:
        small = _patterns(CONFIG_PATTERNS + TOKENIZER_PATTERNS + (SAFETENSORS_INDEX_PATTERN,), trust_remote_code)
        snap = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=small,
                                 local_files_only=local_only)
        commit = os.path.basename(os.path.normpath(snap))
        if local_only and trust_remote_code and _missing_remote_code(snap):
            raise _NotCached(f"missing {', '.join(_missing_remote_code(snap))}")
        files = _repo_files(repo_id, commit, snap, local_only)
        weights = _safetensors_weights(snap, files)
        if weights:
            if not local_only:
                snapshot_download(repo_id, revision=commit, cache_dir=cache_dir, allow_patterns=weights)
            missing = [w for w in weights + ["config.json"] if not os.path.exists(os.path.join(snap, w))]
            if missing:
                if local_only:
                    raise _NotCached(f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
                raise FileNotFoundError(f"hub model {repo_id!r} (revision {revision or 'main'!r}): {missing[0]} "
                                        f"was not downloaded into {snap}")
            return HubModel(repo_id, revision, snap, None)
        gguf = _gguf_choice(repo_id, files)
        if gguf is None:
            if local_only:
                raise _NotCached("no weights cached")
            raise FileNotFoundError(f"hub model {repo_id!r} (revision {revision or 'main'!r}) holds neither "
                                    "*.safetensors nor .gguf files")
        path = hf_hub_download(repo_id, gguf, revision=commit, cache_dir=cache_dir, local_files_only=local_only)
        return HubModel(repo_id, revision, snap, path)

    return _fetch(repo_id, revision, cache_dir, "model", fetch)


def _snapshot_of(path: str, rel: str) -> str:
    """The snapshot folder holding `path`, the cached copy of repository file `rel`."""
    folder = path
    for _ in range(len(rel.split("/"))):
        folder = os.path.dirname(folder)
    return folder


_TOKENIZER_FILE = re.compile(r"(tokenizer[^/]*|vocab[^/]*|merges[^/]*|[^/]*\.tiktoken|[^/]*\.model)")


def download_tokenizer(repo_id: str, revision: Optional[str] = None, cache_dir: Optional[str] = None,
                       trust_remote_code: bool = False) -> str:
    """Fetch the tokenizer files (and config.json, which transformers reads to pick the tokenizer class) of hub
    repository `repo_id` (``--tokenizer-path org/name``), cache first, as `download_model`.

    Args:
        repo_id, revision, cache_dir, trust_remote_code: as `download_model`.

    Returns:
        The local snapshot folder, for ``AutoTokenizer.from_pretrained``.

    Raises:
        FileNotFoundError: as `download_model`, or the repository holds no tokenizer file.
    """
    from huggingface_hub import snapshot_download

    def fetch(local_only: bool) -> str:
        snap = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_only,
                                 allow_patterns=_patterns(("config.json",) + TOKENIZER_PATTERNS, trust_remote_code))
        if local_only and trust_remote_code and os.path.isdir(snap) and _missing_remote_code(snap):
            raise _NotCached(f"missing {', '.join(_missing_remote_code(snap))}")
        cached = _local_files(snap) if os.path.isdir(snap) else []
        if not any(_TOKENIZER_FILE.fullmatch(f) for f in cached):
            if local_only:
                raise _NotCached("no tokenizer files cached")
            raise FileNotFoundError(f"hub repository {repo_id!r} (revision {revision or 'main'!r}) holds no "
                                    f"tokenizer files ({', '.join(TOKENIZER_PATTERNS)})")
        return snap

    return _fetch(repo_id, revision, cache_dir, "tokenizer", fetch)


ADAPTER_PATTERNS = ("adapter_config.json", "adapter_model.safetensors")


def download_adapter(repo_id: str, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> str:
    """Fetch a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) of hub repository
    `repo_id` (``--lora-paths name=org/adapter``, ``/load_lora_adapter``), cache first, as `download_model`.

    Returns:
        The local snapshot folder.

    Raises:
        FileNotFoundError: as `download_model`, or the repository lacks one of the two files.
    """
    from huggingface_hub import snapshot_download

    def fetch(local_only: bool) -> str:
        snap = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_only,
                                 allow_patterns=list(ADAPTER_PATTERNS))
        missing = [f for f in ADAPTER_PATTERNS if not os.path.exists(os.path.join(snap, f))]
        if missing:
            if local_only:
                raise _NotCached(f"missing {', '.join(missing)}")
            raise FileNotFoundError(f"hub repository {repo_id!r} (revision {revision or 'main'!r}) holds no "
                                    f"{', '.join(missing)}: not a PEFT adapter")
        return snap

    return _fetch(repo_id, revision, cache_dir, "adapter", fetch)
