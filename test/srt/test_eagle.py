"""EAGLE and EAGLE-3 heads (``--speculative-algorithm EAGLE|EAGLE3``) through the real runners, against PyTorch.

A tiny random target (transformers' Llama, 4 layers, weights large enough that its greedy tokens follow the
context) and tiny random heads in the published formats (``LlamaForCausalLMEagle3``; SafeAILab's EAGLE head), written
by hand: transformers has no class for them. The reference heads are built from transformers' own Llama attention
(EAGLE-3's q/k/v over the 2H-wide input), MLP, RMSNorm and rotary embedding, in float32, fed the target's hidden
states from transformers (``output_hidden_states``: layer l's output is ``hidden_states[l + 1]``, the final-norm
output the last entry).

One request goes through what the scheduler does: a prefill and the head's draft extend, a draft decode step, then a
verify step of a chain whose first two drafts are the target's greedy tokens (two accepted, a bonus token) and the
head's draft extend after it. At each point the head's stored draft token and hidden state must be the reference's:
every committed position's draft K/V must be what a draft extend over the whole sequence computes.
"""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest
import torch

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.mem_cache.kv_memory import KVMemory, kv_spec_for
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.model_executor.model_runner import ModelRunner, setup_jax
from sgl_jax.srt.models.llama_eagle3 import eagle_aux_layer_ids, hot_token_ids
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.scheduler.speculative.draft_model import draft_server_args, draft_step_batch
from sgl_jax.srt.scheduler.speculative.eagle_draft import (
    EagleDraft, draft_extend_batch, eagle_head_config, new_eagle_draft)
from sgl_jax.srt.scheduler.output import process_batch_result
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch
from sgl_jax.srt.scheduler.speculative.speculation import SpecCounts, Speculator, build_verify_batch
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.speculative.draft_tree import TopkTree, chain_parents

from srt_helpers import save_tiny_eagle3_head, save_tiny_eagle_head, save_tiny_llama

AUX_IDS = (0, 1, 2)
CONTEXT = 256
HIDDEN_TOL = 2e-4  # float32 |our - reference| of the head's hidden state (measured ~1e-6)


class HeadReference:
    """An EAGLE-3 head (`eagle3`) or an EAGLE head in PyTorch from transformers' Llama pieces (see the module
    docstring)."""

    def __init__(self, head_dir: str, target, eagle3: bool):
        from safetensors.torch import load_file
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, \
            LlamaRotaryEmbedding

        with open(os.path.join(head_dir, "config.json")) as f:
            raw = json.load(f)
        cfg = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        cfg._attn_implementation = "eager"
        t = load_file(os.path.join(head_dir, "model.safetensors"))
        layer = "midlayer." if eagle3 else "layers.0."
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.eagle3 = eagle3
        self.attn = LlamaAttention(cfg, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):
            w = t[f"{layer}self_attn.{name}.weight"]
            setattr(self.attn, name, torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
            getattr(self.attn, name).weight.data = w
        self.attn.o_proj.weight.data = t[f"{layer}self_attn.o_proj.weight"]
        self.mlp = LlamaMLP(cfg)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(self.mlp, name).weight.data = t[f"{layer}mlp.{name}.weight"]
        self.norms = {}
        names = (("input", "midlayer.input_layernorm"), ("hidden", "midlayer.hidden_norm"), ("final", "norm"))
        for name, key in names[:3 if eagle3 else 0] + (("post", f"{layer}post_attention_layernorm"),):
            self.norms[name] = LlamaRMSNorm(h, eps=eps)
            self.norms[name].weight.data = t[f"{key}.weight"]
        self.rope = LlamaRotaryEmbedding(cfg)
        self.fc, self.fc_bias = t["fc.weight"], t.get("fc.bias")
        self.embed = target.model.embed_tokens.weight.detach()  # (the target's: tied, its LM head too)
        self.lm_head = t["lm_head.weight"] if eagle3 else self.embed
        self.hot = torch.as_tensor(hot_token_ids(t["d2t"].numpy(), len(self.lm_head)) if eagle3
                                   else np.arange(len(self.lm_head), dtype=np.int32))

    @torch.no_grad()
    def run(self, next_tokens, features, extra_tokens=()):
        """Rows 0..n-1 fed (embed(next_tokens[p]), the target's features[p]), then one row per `extra_tokens` entry
        fed its embedding and the previous row's output (draft decode steps). Returns (outputs [N, H], draft tokens
        [N])."""
        rows_h = [features @ self.fc.T if self.eagle3 else features]
        tokens = torch.as_tensor(list(next_tokens) + list(extra_tokens))
        out = None
        for k in range(len(extra_tokens) + 1):  # each decode row needs the output of the row before
            h = torch.cat(rows_h)[:len(next_tokens) + k]
            out = self._forward(tokens[:len(h)], h)
            if k < len(extra_tokens):
                rows_h.append(out[-1:])
        return out, self.hot[self.logits(out).argmax(-1)]

    def logits(self, out):
        """The head's logits over its columns (`hot` maps them to target ids) of outputs `out` [N, H]."""
        return (self.norms["final"](out) if self.eagle3 else out) @ self.lm_head.T

    @torch.no_grad()
    def top(self, next_tokens, features, path, k: int):
        """(target ids int[k], log-probabilities float[k]) the head ranks best after the draft `path` (the tokens
        after the root, [] for the root's own row), best first."""
        out, _ = self.run(next_tokens, features, extra_tokens=path)
        lp = torch.log_softmax(self.logits(out[-1:])[0].double(), -1)
        best = torch.topk(lp, k)
        return self.hot[best.indices].numpy(), best.values.numpy()

    def _forward(self, tokens, h):
        n = len(tokens)
        emb = self.embed[tokens]
        if self.eagle3:  # x = [norm(embedding), norm(h)] (2H wide), residual h
            x = torch.cat([self.norms["input"](emb), self.norms["hidden"](h)], -1)
        else:  # x = fc([embedding, h]) is both the attention's input (no norm) and the residual
            h = x = torch.cat([emb, h], -1) @ self.fc.T + self.fc_bias
        cos, sin = self.rope(x[None], torch.arange(n)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        a, _ = self.attn(hidden_states=x[None], position_embeddings=(cos, sin), attention_mask=mask)
        h = h + a[0]
        return h + self.mlp(self.norms["post"](h))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("eagle")
    target_dir, tok_dir = save_tiny_llama(d / "target", num_layers=4, init_std=0.2)
    heads = {"EAGLE3": save_tiny_eagle3_head(d / "eagle3", aux_layer_ids=AUX_IDS),
             "EAGLE": save_tiny_eagle_head(d / "eagle")}
    hf = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    return target_dir, tok_dir, heads, hf


def hf_features(hf, ids, eagle3: bool):
    """(the target's features of `ids` from transformers: EAGLE-3's aux hidden states [n, 3H], EAGLE's final hidden
    states [n, H]; its greedy next token)."""
    with torch.no_grad():
        out = hf(torch.as_tensor([ids]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[l + 1][0] for l in AUX_IDS], -1) if eagle3 else out.hidden_states[-1][0]
    return feats, int(out.logits[0, -1].argmax())


def hf_greedy(hf, ids, n):
    out = list(ids)
    for _ in range(n):
        out.append(hf_features(hf, out, False)[1])
    return out[len(ids):]


def test_aux_layer_ids_follow_sglang():
    class Cfg:
        eagle_config = None
    assert eagle_aux_layer_ids(Cfg(), 32) == (1, 15, 28)  # (1, L/2 - 1, L - 4): layer outputs
    assert eagle_aux_layer_ids(Cfg(), 8) == (1, 3, 4)
    Cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [2, 0, 1]}
    assert eagle_aux_layer_ids(Cfg(), 4) == (0, 1, 2)
    for bad in ([0, 0, 1], [0, 1, 4]):
        Cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": bad}
        with pytest.raises(ValueError, match="distinct layers"):
            eagle_aux_layer_ids(Cfg(), 4)


def _prefilled(models, algorithm: str, page_size: int, topk: int = 1, quantization=None):
    """A target runner (with `quantization`: ``--quantization`` of it) and `new_eagle_draft`'s head on one request
    prefilled and draft-extended (its first draft token and hidden state checked against the reference). Returns a
    namespace of what the tests use."""
    target_dir, tok_dir, heads, hf = models
    eagle3 = algorithm == "EAGLE3"
    ref = HeadReference(heads[algorithm], hf, eagle3)
    args = ServerArgs(model_path=target_dir, tokenizer_path=tok_dir, page_size=page_size, max_total_tokens=1024,
                      context_length=CONTEXT, disable_precompile=True, disable_radix_cache=True,
                      speculative_algorithm=algorithm, speculative_draft_model_path=heads[algorithm],
                      speculative_eagle_topk=topk, quantization=quantization)
    setup_jax(args)
    mc = ModelConfig.from_server_args(args, "cpu")
    buckets = ShapeBuckets((64,), (1, 4), verify_tokens=args.speculative_num_draft_tokens)
    target = ModelRunner(args, mc, buckets=buckets, max_context_len=CONTEXT,
                         kv_spec_fn=lambda _: kv_spec_for(args, mc, 1024), num_request_slots=4,
                         aux_layers=AUX_IDS if eagle3 else ())
    head_mc = eagle_head_config(ModelConfig.from_server_args(draft_server_args(args, CONTEXT), "cpu"), mc, algorithm)
    draft = new_eagle_draft(args, target, buckets, head_mc)
    features = (lambda out: out.aux) if eagle3 else (lambda out: out.hidden)  # noqa: E731
    memory = KVMemory.create(target.kv_spec, num_request_slots=4, context_len=CONTEXT, disable_radix_cache=True)

    prompt = [int(x) for x in np.random.default_rng(page_size).integers(100, 49000, 21)]
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    params.normalize()
    req = Req("r0", prompt, params, eos_token_ids=[], seed=0)
    req.extend_input_len = len(prompt)

    # prefill, then the head's draft extend over the prompt fed its next tokens and the sampled one
    batch = ScheduleBatch([req], ForwardMode.EXTEND)
    batch.prepare_for_extend(memory)
    wb = batch.build_model_worker_batch(buckets, memory)
    launched = batch.launched()
    out = target.forward(wb)
    aux, t_n = hf_features(hf, prompt, eagle3)
    np.testing.assert_allclose(np.asarray(features(out))[:len(prompt)], aux.numpy(), atol=1e-4, rtol=1e-4)
    process_batch_result(launched, out, memory, target.full_logprobs, lambda r, ids: "")
    assert req.output_ids == [t_n]
    draft.runner.draft_extend(*_extend_args(launched, wb, out, features))
    ref_out, ref_tok = ref.run(prompt[1:] + [t_n], aux)
    check_state(draft, req, ref_tok[-1], ref_out[-1])
    return types.SimpleNamespace(ref=ref, hf=hf, eagle3=eagle3, buckets=buckets, target=target, draft=draft,
                                 features=features, memory=memory, prompt=prompt, req=req, aux=aux, t_n=t_n)


def check_state(draft, req, ref_token, ref_hidden) -> None:
    """The head's stored draft token and hidden state of `req`'s slot (one DP rank: the state row is the slot)."""
    assert draft.runner.tokens()[req.req_pool_idx] == ref_token
    np.testing.assert_allclose(np.asarray(draft.runner.states[0])[req.req_pool_idx], ref_hidden.numpy(),
                               atol=HIDDEN_TOL, rtol=HIDDEN_TOL)


def verify_and_extend(s, tree) -> list:
    """A verify step of `tree` (tokens, parents) for s.req, accepted greedily, its K/V moves on the target and the
    head after the head's draft extend (as the scheduler orders them); returns the tokens it appended."""
    req, memory = s.req, s.memory
    n_out = len(req.output_ids)
    verify = ScheduleBatch([req], ForwardMode.TARGET_VERIFY, {id(req): tree})
    wb = build_verify_batch(verify, s.buckets, memory)
    launched = verify.launched()
    out = s.target.forward(wb)
    spec = Speculator(None, CONTEXT, chain_only=False, num_draft_tokens=len(tree[0]))
    spec.apply_verify(launched, out, memory, lambda r, ids: "")
    s.draft.runner.draft_extend(*_extend_args(launched, wb, out, s.features))
    moves = spec.take_moves()
    if len(moves[0]):
        s.target.move_kv([moves])
        s.draft.move_kv([moves])
    return req.output_ids[n_out:]


@pytest.mark.parametrize("algorithm,page_size", [("EAGLE3", 1), ("EAGLE3", 16), ("EAGLE", 16)])
def test_head_matches_reference_through_prefill_draft_and_verify(models, algorithm, page_size):
    s = _prefilled(models, algorithm, page_size)
    req, memory, ref, prompt, t_n = s.req, s.memory, s.ref, s.prompt, s.t_n

    # one draft decode step: the stored token at the root's position, with the stored hidden state
    d1 = int(s.draft.runner.tokens()[req.req_pool_idx])
    decode = ScheduleBatch([req], ForwardMode.DECODE)
    assert decode.prepare_for_decode(memory)
    assert memory.allocate_drafts(req, 3)
    step = draft_step_batch([req], [d1], 0, memory, (ForwardMode.DECODE, *s.buckets.decode_shape(1)))
    tok = s.draft.runner.draft_decode([step], [np.asarray([req.req_pool_idx], np.int32)])
    _, ref_tok2 = ref.run(prompt[1:] + [t_n], s.aux, extra_tokens=[d1])
    assert tok[req.req_pool_idx] == ref_tok2[-1]

    # verify [t_n, greedy, greedy, wrong]: two drafts accepted, a bonus; then the draft extend after it
    greedy = hf_greedy(s.hf, prompt + [t_n], 3)
    chain = np.asarray([t_n, greedy[0], greedy[1], (greedy[2] + 1) % 49152], np.int32)
    assert verify_and_extend(s, (chain, chain_parents(4))) == greedy
    assert req.seqlen == len(prompt) + 4
    seq = prompt + [t_n] + greedy
    ref_out, ref_tok = ref.run(seq[1:], hf_features(s.hf, seq[:-1], s.eagle3)[0])
    check_state(s.draft, req, ref_tok[-1], ref_out[-1])


def test_head_over_an_int8_target_reads_its_int8_tables(models):
    """--quantization int8 on the target: its embedding table (tied LM head) is int8 in groups
    (methods.table_scheme), and the EAGLE head embeds its tokens and computes its logits from that table as stored
    (no float copy): the target, fed to transformers as its dequantized weights, and the head match the reference
    through a prefill, a draft extend and a draft decode step."""
    from transformers import LlamaForCausalLM

    from sgl_jax.srt.quantization.methods import QuantScheme, dequantize_rows, quantize_for, table_scheme

    target_dir, tok_dir, heads, _ = models
    hf = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in hf.state_dict().items():
            table = name.endswith("embed_tokens.weight")
            if table or name.endswith("_proj.weight"):  # quantized as the loader does, on the host
                q, scale = quantize_for(w.numpy(), table_scheme(w.shape[1]) if table else QuantScheme("int8"))
                w.copy_(torch.from_numpy(dequantize_rows(q, scale, np.float32)))
    s = _prefilled((target_dir, tok_dir, heads, hf), "EAGLE", 16, quantization="int8")
    for table in (s.draft.runner.embed, s.draft.runner.target_head):
        assert isinstance(table, tuple) and table[0].dtype == np.int8 and table[1].shape == (49152, 1)
    req = s.req
    d1 = int(s.draft.runner.tokens()[req.req_pool_idx])
    decode = ScheduleBatch([req], ForwardMode.DECODE)
    assert decode.prepare_for_decode(s.memory)
    assert s.memory.allocate_drafts(req, 3)
    step = draft_step_batch([req], [d1], 0, s.memory, (ForwardMode.DECODE, *s.buckets.decode_shape(1)))
    tok = s.draft.runner.draft_decode([step], [np.asarray([req.req_pool_idx], np.int32)])
    _, ref_tok2 = s.ref.run(s.prompt[1:] + [s.t_n], s.aux, extra_tokens=[d1])
    assert tok[req.req_pool_idx] == ref_tok2[-1]


@pytest.mark.parametrize("algorithm,page_size", [("EAGLE3", 1), ("EAGLE", 16)])
def test_topk_tree_matches_reference_and_kv_follows_an_accepted_side_branch(models, algorithm, page_size):
    """--speculative-eagle-topk 2, 3 steps, 7 slots: the head's tree (its first level from the draft extend's
    top-2, then two tree steps over forests fed their parents' outputs) is the tree the reference head's top-2
    after every frontier path grows (`TopkTree`). Then a verify step accepts a path off the first branch: the
    head's state is its last slot's, and after the K/V moves a second tree is again the reference's (every
    committed position's head K/V in place)."""
    s = _prefilled(models, algorithm, page_size, topk=2)
    req, memory, ref = s.req, s.memory, s.ref
    assert isinstance(s.draft, EagleDraft) and s.draft.topk == 2 and s.draft.num_steps == 3

    def drafted_tree():
        decode = ScheduleBatch([req], ForwardMode.DECODE)
        assert decode.prepare_for_decode(memory)
        assert memory.allocate_drafts(req, 6)
        rank = types.SimpleNamespace(memory=memory)
        tokens, parents = s.draft._decode_trees([[(req, 7)]], [rank])[0][id(req)]
        assert req.kv_allocated_len == req.seqlen - 1 + len(tokens)  # (unused draft slots given back)
        return tokens, parents

    def reference_tree():
        seq = req.origin_input_ids + req.output_ids
        feats = hf_features(s.hf, seq[:-1], s.eagle3)[0]
        tree = TopkTree(seq[-1], 2)
        for _ in range(3):
            paths = [_path(tree, node) for node in tree.frontier]
            tops = [ref.top(seq[1:], feats, path, 2) for path in paths]
            tree.expand(np.stack([t for t, _ in tops]), np.stack([lp for _, lp in tops]))
        return tree.final(7)

    tokens, parents = drafted_tree()
    want_tokens, want_parents = reference_tree()
    np.testing.assert_array_equal(parents, want_parents)
    np.testing.assert_array_equal(tokens, want_tokens)
    assert s.draft.num_draft_steps == 2

    # a verify tree whose first branch is wrong and whose second is the target's greedy path: slots 2 and 4 are
    # accepted, and the kept position's row is slot 4, not slot 3 before it at the same depth
    greedy = hf_greedy(s.hf, req.origin_input_ids + req.output_ids, 3)
    wrong = [(g + 1) % 49152 for g in greedy]
    memory.rollback(req, req.seqlen - 1 + 5)
    req.spec = SpecCounts()  # (as the server keeps it: `SpecCounts.last_slot`)
    side = (np.asarray([req.output_ids[-1], wrong[0], greedy[0], wrong[1], greedy[1]], np.int32),
            np.asarray([-1, 0, 0, 1, 2], np.int32))
    assert verify_and_extend(s, side) == greedy[:3] and req.spec.last_slot == 4
    seq = req.origin_input_ids + req.output_ids
    ref_out, ref_tok = ref.run(seq[1:], hf_features(s.hf, seq[:-1], s.eagle3)[0])
    check_state(s.draft, req, ref_tok[-1], ref_out[-1])
    tokens, parents = drafted_tree()  # reads the head's K/V at every committed position (moved ones included)
    want_tokens, want_parents = reference_tree()
    np.testing.assert_array_equal(parents, want_parents)
    np.testing.assert_array_equal(tokens, want_tokens)
    # and to the hidden state's tolerance: a draft decode step from the stored token reads the same K/V
    d1 = int(s.draft.runner.tokens()[req.req_pool_idx])
    step = draft_step_batch([req], [d1], 0, memory, (ForwardMode.DECODE, *s.buckets.decode_shape(1)))
    s.draft.runner.draft_decode([step], [np.asarray([req.req_pool_idx], np.int32)])
    ref_out, ref_tok = ref.run(seq[1:], hf_features(s.hf, seq[:-1], s.eagle3)[0], extra_tokens=[d1])
    check_state(s.draft, req, ref_tok[-1], ref_out[-1])


def _path(tree: TopkTree, node: int) -> list:
    """The tokens from the root's child down to `node` (none for the root)."""
    path = []
    while node:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


def _extend_args(launched, wb, out, features):
    """`EagleRunner.draft_extend`'s arguments for one rank's step (what `EagleDraft.after_step` passes)."""
    batch, rows = draft_extend_batch(launched, wb, out)
    return [batch], features(out), [rows]
