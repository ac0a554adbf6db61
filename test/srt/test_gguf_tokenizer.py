"""The tokenizer rebuilt from GGUF metadata (model_loader/gguf_tokenizer.py) against transformers' own GGUF
tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, its port of llama.cpp's vocabularies), on a
few hundred strings: prose and code from Python's own docs, Unicode (accents, CJK, emoji with joiners, math
letters), whitespace runs, digits, control bytes and special-token spellings. And a GGUF whose
``tokenizer.ggml.pre`` is unknown: the server refuses it with an error naming it, unless --tokenizer-path is
given (issue #20).
"""

from __future__ import annotations

import os
import random

import pytest

from sgl_jax.srt.configs.model_config import resolve_model_path
from sgl_jax.srt.model_loader.default_model import GEMMA3_270M_PACKAGE, find_packaged_gguf
from sgl_jax.srt.model_loader.gguf_file import UNSUPPORTED_TOKENIZER_FILE, check_gguf_tokenizer_dir, prepare_gguf_hf_dir
from sgl_jax.srt.model_loader.gguf_tokenizer import UnsupportedGGUFTokenizer

FRAGMENTS = [
    "Hello", " world", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "naïve café", "résumé", "Ünïcödé",
    "日本語のテキスト", "中文文本", "한국어", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𝑥²+𝑦²", "ﬁ", "Å",
    "\u200b", "\u00a0", "\x00", "\x7f", "1234567890", "3.14159", "-42", "0x1F", "1e-10", "It's", "isn't", "I'll",
    "def f(x):", "    return x", "{ }", "();", "<b>", "</td>", "==", "!=", "->", "=>", "//", "#", "'''", '"""',
    "https://example.com/a?b=c&d=e", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<eos>",
    "<0x41>", "a" * 20, "=" * 17, " " * 33,
]


def corpus(n_docs: int = 150, n_mixed: int = 150, seed: int = 0):
    """n_docs slices of Python's pydoc topics (prose and code, offline) and n_mixed random joins of FRAGMENTS."""
    import pydoc_data.topics

    rng = random.Random(seed)
    text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    docs = []
    for _ in range(n_docs):
        start = rng.randrange(len(text) - 400)
        docs.append(text[start:start + rng.randrange(1, 400)])
    mixed = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 12))) for _ in range(n_mixed)]
    return docs + mixed + ["", " ", "\n"]


def assert_same_tokenizer(ours, ref, texts):
    mismatches = [t for t in texts if ours.encode(t) != ref.encode(t)]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} strings tokenize differently, e.g. {mismatches[:3]!r}"
    for t in texts:
        ids = ours.encode(t)
        assert ours.decode(ids) == ref.decode(ids), t


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_gguf_tokenizer_matches_transformers_on_hundreds_of_strings(model):
    """Same ids and decoded text as transformers' GGUF tokenizer on 303 strings.

    For SmolLM2 (``tokenizer.ggml.pre`` "smollm") the reference is first given llama.cpp's digit split:
    llama.cpp splits on ``\\p{N}`` (each digit its own piece) before the GPT-2 pattern for this pre type
    (src/llama-vocab.cpp, as SmolLM2's own tokenizer.json does with Digits(individual_digits) + ByteLevel),
    while transformers' GGUF converter gives every gpt2 vocabulary the plain GPT-2 pattern. Without it the
    two differ on 14 of the strings, all at a whitespace run before a digit ("x   1": ours and llama.cpp
    "x", "ĠĠĠ", "1"; transformers "x", "ĠĠ", "Ġ", "1")."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    path = resolve_model_path(None).gguf_file if model == "smollm2" else find_packaged_gguf(GEMMA3_270M_PACKAGE)
    ours = AutoTokenizer.from_pretrained(prepare_gguf_hf_dir(path))
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    texts = corpus()
    assert len(texts) >= 300
    if model == "smollm2":
        assert ours.convert_ids_to_tokens(ours.encode("x   1/0")) == ["x", "ĠĠĠ", "1", "/", "0"]
        backend = ref.backend_tokenizer
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         backend.pre_tokenizer])
    assert ours.get_vocab() == ref.get_vocab()
    assert_same_tokenizer(ours, ref, texts)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_load_tokenizer_of_a_gguf_dir_is_the_one_autotokenizer_loads(model):
    """`load_tokenizer` loads a directory built from a GGUF with the class that saved it (`gguf_tokenizer_class`,
    without AutoTokenizer's dispatch): the same class, vocabulary, special tokens, chat template, ids and text as
    ``AutoTokenizer.from_pretrained`` of that directory; and without loading AutoTokenizer's module."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from sgl_jax.srt.configs.model_config import load_tokenizer
    from sgl_jax.srt.model_loader.gguf_file import gguf_tokenizer_class
    from sgl_jax.srt.server_args import ServerArgs

    path = None if model == "smollm2" else find_packaged_gguf(GEMMA3_270M_PACKAGE)
    hf_dir = prepare_gguf_hf_dir(resolve_model_path(path).gguf_file)
    assert gguf_tokenizer_class(hf_dir) is not None
    ours, ref = load_tokenizer(ServerArgs(model_path=path)), AutoTokenizer.from_pretrained(hf_dir)
    assert type(ours) is type(ref)
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.all_special_tokens == ref.all_special_tokens and ours.all_special_ids == ref.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.eos_token_id,
                                                                          ref.pad_token_id)
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."}]
    assert ours.chat_template and ours.chat_template == ref.chat_template
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert_same_tokenizer(ours, ref, corpus(30, 30))
    assert ours("a b", add_special_tokens=True)["input_ids"] == ref("a b", add_special_tokens=True)["input_ids"]
    # a server process that loads it never imports AutoTokenizer's module (its import table: ~1 s a process)
    code = ("import sys; from sgl_jax.srt.configs.model_config import load_tokenizer; "
            "from sgl_jax.srt.server_args import ServerArgs; "
            f"load_tokenizer(ServerArgs(model_path={path!r})); "
            "print('transformers.models.auto.tokenization_auto' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def copy_gguf_metadata(src: str, dst: str, **overrides) -> None:
    """A GGUF at `dst` with `src`'s metadata (`overrides`: string values replaced) and one tiny tensor: enough
    for the HF config and the tokenizer, which read metadata only."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = overrides.get(key, field.contents())
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_pre_tokenizer_is_refused_unless_a_tokenizer_path_is_given(tmp_path, monkeypatch):
    from sgl_jax.srt.configs.model_config import load_tokenizer
    from sgl_jax.srt.server_args import ServerArgs

    monkeypatch.setenv("SGL_JAX_CACHE_DIR", str(tmp_path / "cache"))
    smollm2 = resolve_model_path(None)
    path = str(tmp_path / "unknown-pre.gguf")
    copy_gguf_metadata(smollm2.gguf_file, path, **{"tokenizer.ggml.pre": "deepseek-llm"})

    hf_dir = prepare_gguf_hf_dir(path)  # the config is still built; the tokenizer is not
    assert os.path.isfile(os.path.join(hf_dir, "config.json"))
    assert os.path.isfile(os.path.join(hf_dir, UNSUPPORTED_TOKENIZER_FILE))
    with pytest.raises(UnsupportedGGUFTokenizer, match=r"'deepseek-llm' is not supported.*--tokenizer-path"):
        check_gguf_tokenizer_dir(hf_dir)
    with pytest.raises(UnsupportedGGUFTokenizer, match="deepseek-llm"):
        load_tokenizer(ServerArgs(model_path=path))
    # an HF tokenizer given with --tokenizer-path is used instead
    tok = load_tokenizer(ServerArgs(model_path=path, tokenizer_path=smollm2.hf_dir))
    assert tok.encode("Hello world") == load_tokenizer(ServerArgs()).encode("Hello world")

    # a known one (the file's own, "smollm") builds the tokenizer as before
    ok = str(tmp_path / "known-pre.gguf")
    copy_gguf_metadata(smollm2.gguf_file, ok)
    check_gguf_tokenizer_dir(prepare_gguf_hf_dir(ok))
