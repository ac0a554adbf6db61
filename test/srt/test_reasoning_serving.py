"""``--reasoning-parser`` end to end: the openai client against a real server on 127.0.0.1.

The model is a "bigram machine": a tiny Llama (SmolLM2's vocabulary plus the added tokens ``<think>`` and
``</think>``, single tokens that decoding keeps, as in Qwen3's and DeepSeek-R1's tokenizers) whose attention
o_proj and MLP down_proj are zero, so the residual stream is the current token's embedding and the next token
depends on the current one only. Its untied lm_head makes a chain of tokens follow the generation prompt's last
token: a newline is followed by ``<think>Let me think</think>The answer is 4<|im_end|>`` (transformers' greedy
generate checks the chain first), whatever the prompt. The chat template (written here) is Qwen3-like:
``enable_thinking`` false appends an empty thinking part, as Qwen3's does, ending with one newline (Qwen3's
two would be one other token here) -- so the tiny model answers the same, tags and all, and the whole output
must then come back as content. One server, ``--reasoning-parser qwen3`` (deepseek-r1's
forced reasoning is covered by test_reasoning_parser.py: the same code path with another detector).
"""

from __future__ import annotations

import openai
import pytest

from srt_helpers import SMALL_ENGINE_ARGS, module_server, wait_pool_idle

THINKING = "Let me think"
ANSWER = "The answer is 4"
OUTPUT = f"<think>{THINKING}</think>{ANSWER}"
# the chain after the generation prompt's last token (a newline), as tokens of SmolLM2's vocabulary
CHAIN = ["Ċ", "<think>", "Let", "Ġme", "Ġthink", "</think>", "The", "Ġanswer", "Ġis", "Ġ", "4", "<|im_end|>"]

CHAT_TEMPLATE = """{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n' -}}{%- endif -%}
{%- endif -%}
"""

ENGINE_ARGS = dict(SMALL_ENGINE_ARGS, context_length=512, max_total_tokens=2048, precompile_token_paddings=[64],
                   precompile_bs_paddings=[1, 8], chunked_prefill_size=64, max_running_requests=8)
ASK = [{"role": "user", "content": "What is 2+2?"}]


def save_bigram_llama(path) -> str:
    """The bigram machine and its tokenizer saved in `path` (see the module doc); returns `path`."""
    import torch
    from transformers import AddedToken, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from sgl_jax.srt.configs.model_config import resolve_model_path

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(None).hf_dir)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    chain = tok.convert_tokens_to_ids(CHAIN)
    assert tok.unk_token_id not in chain and len(set(chain)) == len(chain)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = torch.zeros_like(model.lm_head.weight)
        for prev, nxt in zip(chain, chain[1:]):  # the logit of nxt after prev: 10 * sqrt(64) = 80
            head[nxt] = 10.0 * emb[prev] / emb[prev].norm()
        model.lm_head.weight.copy_(head)
        prompt = tok.apply_chat_template(ASK, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(prompt, add_special_tokens=False)
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert tok.decode(out, skip_special_tokens=True) == OUTPUT, tok.decode(out)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    (path / "qwen3_like.jinja").write_text(CHAT_TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_bigram_llama(tmp_path_factory.mktemp("bigram_llama"))
    yield from module_server(["--model-path", path, "--chat-template", f"{path}/qwen3_like.jinja",
                              "--reasoning-parser", "qwen3"], engine_args=ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def create(client, **kw):
    return client.chat.completions.create(**{"model": "x", "messages": ASK, "temperature": 0, "max_tokens": 32, **kw})


def reasoning_of(obj):
    return getattr(obj, "reasoning_content", None)


def streamed(client, **kw):
    """Stream a request -> {choice index: (reasoning deltas, content deltas, finish_reason)}."""
    out = {}
    for c in create(client, stream=True, **kw):
        for ch in c.choices:
            r, t, _ = out.setdefault(ch.index, ([], [], None))
            if reasoning_of(ch.delta):
                r.append(reasoning_of(ch.delta))
            if ch.delta.content:
                t.append(ch.delta.content)
            out[ch.index] = (r, t, ch.finish_reason or out[ch.index][2])
    return out


def test_non_stream_splits_the_thinking_part(client):
    r = create(client, n=2)
    assert len(r.choices) == 2
    for ch in r.choices:  # one detector per choice
        assert (reasoning_of(ch.message), ch.message.content, ch.finish_reason) == (THINKING, ANSWER, "stop")


def test_stream_splits_the_thinking_part(client):
    for n in (1, 2):
        out = streamed(client, n=n)
        assert sorted(out) == list(range(n))
        for r, t, fr in out.values():
            assert ("".join(r), "".join(t), fr) == (THINKING, ANSWER, "stop"), (r, t)
    # stream_reasoning false: the reasoning in one delta, when the thinking part ends
    r, t, fr = streamed(client, extra_body={"stream_reasoning": False})[0]
    assert (r, "".join(t), fr) == ([THINKING], ANSWER, "stop")


def test_separate_reasoning_false_keeps_everything_in_content(client):
    r = create(client, extra_body={"separate_reasoning": False})
    assert (reasoning_of(r.choices[0].message), r.choices[0].message.content) == (None, OUTPUT)
    r, t, fr = streamed(client, extra_body={"separate_reasoning": False})[0]
    assert (r, "".join(t), fr) == ([], OUTPUT, "stop")


def test_enable_thinking_false_has_no_reasoning(client):
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        r = create(client, extra_body=extra)
        assert (reasoning_of(r.choices[0].message), r.choices[0].message.content) == (None, OUTPUT), extra
        r, t, fr = streamed(client, extra_body=extra)[0]
        assert (r, "".join(t), fr) == ([], OUTPUT, "stop"), extra


def test_output_cut_inside_the_thinking_part(client):
    """max_tokens ends the output before </think>: all reasoning, no content (streamed: flushed at the end)."""
    r = create(client, max_tokens=3)
    ch = r.choices[0]
    assert (reasoning_of(ch.message), ch.message.content, ch.finish_reason) == ("Let me", None, "length")
    for stream_reasoning in (True, False):
        r, t, fr = streamed(client, max_tokens=3, extra_body={"stream_reasoning": stream_reasoning})[0]
        assert ("".join(r), t, fr) == ("Let me", [], "length")


def test_with_tools_the_tool_parser_sees_the_content(client):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    r = create(client, tools=[tool])
    ch = r.choices[0]
    assert (reasoning_of(ch.message), ch.message.content, ch.message.tool_calls) == (THINKING, ANSWER, None)
    r, t, fr = streamed(client, tools=[tool])[0]
    assert ("".join(r), "".join(t), fr) == (THINKING, ANSWER, "stop")


def test_pool_idle_after(server):
    wait_pool_idle(server.url)
