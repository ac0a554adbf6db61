"""The runners of speculative decoding's draft models: their weights, their K/V buffers (in the target's slots) and
only the programs they run.

`DraftModelRunner` (STANDALONE's draft model): the forward of every step shape (it runs every target step, logits
unused) and the sampling of DECODE shapes (its own greedy draft steps); with top-k trees a top-k program over a tree
step's logits and the K/V moves; no logprob or penalty program.

`EagleRunner`, an EAGLE head's (EAGLE: models/llama_eagle.py, EAGLE-3: models/llama_eagle3.py), with one layer of
K/V buffers and programs of its own:

- **draft extend** (after every target step): the head runs over the step's rows, each fed the token after its
  position and the target's features there (EAGLE-3: the aux hidden states of three layers; EAGLE: the final
  hidden states); at each row `rows` names, its output and the draft token it predicts are stored in the request
  slot's state (``states``: g and tok; with --speculative-eagle-topk k > 1 also the k best tokens and their
  log-probabilities).
- **draft decode** (each draft step of a chain): one row per request, fed a chain token and its slot's stored
  output; both states are overwritten with the new output and token.
- **tree step** (each draft step of a top-k tree, scheduler/speculative/eagle_draft.py): a TARGET_VERIFY forward
  over each request's fed forest, every node fed its parent's output (the slot's stored g, or the step before's output,
  kept in ``node_out``); the k best next tokens of every node come back to the host. With trees the head's K/V
  moves with an accepted path off the first branch (the K/V move programs).

States are per request slot (rank r's slot s is row ``r * num_request_slots + s``), so a request's first draft
token and hidden state wait in them however many steps pass before it drafts. Drafting is greedy: a token is the
argmax of the head's logits (its own LM head's, mapped to target ids by the ``hot`` map, or the target's LM head's),
no sampling program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sgl_jax.srt.forward_batch import ForwardMode, ModelWorkerBatch
from sgl_jax.srt.model_executor.model_runner import ModelRunner
from sgl_jax.srt.model_executor.packed_inputs import unpack
from sgl_jax.srt.model_executor.runner_programs import lower_forward, lower_move, lower_sample
from sgl_jax.srt.model_loader.loader import JNP_DTYPES


def top_k_logprobs(logits: jax.Array, k: int) -> Tuple[jax.Array, jax.Array]:
    """(float32[rows, k] each row's k best log-probabilities, best first; int32[rows, k] their columns) of logits
    [rows, V] (a draft step's top-k: SGLang's EAGLE search takes the draft's log-probabilities)."""
    lp, idx = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
    return lp, idx.astype(jnp.int32)


class DraftModelRunner(ModelRunner):
    """A `ModelRunner` of STANDALONE's draft model (see the module docstring); ModelRunner's arguments, and
    ``topk`` (--speculative-eagle-topk): with k > 1 it drafts top-k trees, so it also runs a top-k program over a
    tree step's logits (`tree_top`) and K/V moves (its K/V moves with an accepted path off the first branch)."""

    fused_steps = False  # (its forward runs without sampling on every target step: the split programs serve both)

    def __init__(self, *args, topk: int = 1, **kwargs):
        self.topk = int(topk)
        super().__init__(*args, **kwargs)
        self._tree_top = jax.jit(functools.partial(top_k_logprobs, k=self.topk),
                                 out_shardings=(self._replicated, self._replicated))

    def tree_top(self, fwd) -> Tuple[np.ndarray, np.ndarray]:
        """A tree step's (`launch_forward` of a TARGET_VERIFY batch) k most likely next tokens after every slot, on
        the host: (float32[dp * T_pad, topk] log-probabilities, int32[dp * T_pad, topk] ids), best first; only these
        leave the device, not the [dp * T_pad, V] logits."""
        lp, idx = self._tree_top(fwd.logits)
        self._check_no_new_compile(None)
        return np.asarray(lp), np.asarray(idx)

    def warmup_programs(self) -> List[Tuple[str, object]]:
        """Every step shape's forward, the sampling of DECODE shapes, and with top-k > 1 the top-k and the K/V moves
        of each verify shape."""
        shapes = self.buckets.all_shapes()
        programs = [(f"draft {mode.name.lower()} T={t} S={s}", lower_forward(self, mode, t, s))
                    for mode, t, s in shapes]
        programs += [(f"draft sampling S={s}", lower_sample(self, mode, t, s)) for mode, t, s in shapes
                     if mode == ForwardMode.DECODE]
        if self.topk > 1:
            for mode, t, _ in shapes:
                if mode == ForwardMode.TARGET_VERIFY:
                    programs += [(f"draft top-{self.topk} T={t}", self._lower_top(t)),
                                 (f"draft KV move M={t}", lower_move(self, t))]
        return programs

    def _lower_top(self, t_pad: int):
        """A thunk lowering the top-k program of one verify shape's logits."""
        def lower():
            logits = jax.ShapeDtypeStruct((self.dp_size * t_pad, self.logits_vocab), jnp.float32,
                                          sharding=self._replicated)
            return self._tree_top.lower(logits)
        return lower


class EagleRunner(ModelRunner):
    """A `ModelRunner` of an EAGLE head (`LlamaForCausalLMEagle` or `LlamaForCausalLMEagle3`; see the module
    docstring).

    Args:
        server_args, model_config, buckets, max_context_len, kv_spec_fn, num_request_slots: as `ModelRunner`.
        embed: the target's embedding table [V, H] on device (the head reads the target's embeddings).
        target_head: the target's LM head [V, H] on device (an EAGLE head's logits; an EAGLE-3 head has its own).
        hot: int32[logits columns], the target id of each column of the head's logits (`llama_eagle3.
            hot_token_ids`; the identity over the target's vocabulary).
        aux_width: the width of the target's features (EAGLE-3: n * hidden size; EAGLE: hidden size).
        aux_dtype: their dtype (the target's).
        topk: --speculative-eagle-topk: with k > 1 the draft extend stores each row's k best next tokens and their
            log-probabilities too, and the head runs tree steps (`draft_tree`) and K/V moves.
    """

    def __init__(self, server_args, model_config, *, buckets, max_context_len: int, kv_spec_fn,
                 num_request_slots: int, embed: jax.Array, target_head: jax.Array, hot: np.ndarray,
                 aux_width: int, aux_dtype, topk: int = 1):
        super().__init__(server_args, model_config, buckets=buckets, max_context_len=max_context_len,
                         kv_spec_fn=kv_spec_fn, num_request_slots=num_request_slots)
        r = self._replicated
        self.embed, self.target_head = embed, target_head
        self.hot = jax.device_put(np.asarray(hot, np.int32), r)
        self.aux_width, self.aux_dtype = int(aux_width), jnp.dtype(aux_dtype)
        self.num_state_rows = self.dp_size * num_request_slots
        dtype = JNP_DTYPES[model_config.dtype]
        self.topk = int(topk)
        zeros = lambda shape, dt: jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=r)()  # noqa: E731
        self.states = (zeros((self.num_state_rows, model_config.hidden_size), dtype),  # g: the stored outputs
                       zeros((self.num_state_rows,), jnp.int32),  # tok: the stored draft tokens
                       zeros((self.num_state_rows, self.topk), jnp.int32),  # their top-k (trees only)
                       zeros((self.num_state_rows, self.topk), jnp.float32))  # and its log-probabilities
        out = (self._kv_sharding, (r, r, r, r))
        self._draft_extend = jax.jit(functools.partial(self._draft_impl, project=True), donate_argnums=(1, 2),
                                     static_argnums=(4,), out_shardings=out)
        self._draft_decode = jax.jit(functools.partial(self._draft_impl, project=False), donate_argnums=(1, 2),
                                     static_argnums=(4,), out_shardings=out)
        if self.topk > 1:  # the tree steps' outputs, [dp, the largest verify T_pad] rows
            self.tree_rows = max((t for mode, t, _ in buckets.all_shapes() if mode == ForwardMode.TARGET_VERIFY),
                                 default=0)
            self.node_out = zeros((self.dp_size * self.tree_rows, model_config.hidden_size), dtype)
            self._draft_tree = jax.jit(self._tree_impl, donate_argnums=(1, 2), static_argnums=(4,),
                                       out_shardings=(self._kv_sharding, r, r, r))

    def _draft_impl(self, param_leaves, kv_caches, states, packed, layout, hidden, rows, embed, target_head, hot, *,
                    project: bool):
        """One head forward. hidden: [dp * T_pad, aux_width] the target's features (`project`), else
        ignored: each token reads its request's stored output ``g[rows]``; rows: int32[dp * T_pad] (decode)
        or int32[dp * R_pad] (extend, per logits row), the state row each token's (row's) result is written to,
        ``num_state_rows`` to write nothing (and to read row 0). Returns (kv_caches, states: g, tok, and with
        top-k > 1 after an extend each row's top-k tokens and log-probabilities)."""
        g_state, tok_state, top_tok, top_lp = states
        model, fb = self._model_and_batch(param_leaves, packed, layout)
        if not project:
            hidden = g_state[jnp.minimum(rows, self.num_state_rows - 1)]
        out, kv_caches = model(fb, kv_caches, hidden, embed, project=project)
        at = out[fb.logits_indices]
        logits = self._gathered(model.draft_logits(at, target_head))
        tok = hot[jnp.argmax(logits, axis=-1)].astype(jnp.int32)
        g_state = g_state.at[rows].set(at.astype(g_state.dtype), mode="drop")
        tok_state = tok_state.at[rows].set(tok, mode="drop")
        if project and self.topk > 1:
            lp, idx = self._top(logits, hot)
            top_tok, top_lp = top_tok.at[rows].set(idx, mode="drop"), top_lp.at[rows].set(lp, mode="drop")
        return kv_caches, (g_state, tok_state, top_tok, top_lp)

    def _model_and_batch(self, param_leaves, packed, layout):
        """(the head's module from its parameter leaves, the packed ForwardBatch unpacked with its rows by rank): the
        start of every head program."""
        fb = unpack(packed, layout)
        fb = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self._rank_rows), fb)
        fb = dataclasses.replace(fb, attention_backend=self.attention_backend)
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._param_treedef, param_leaves)), fb

    def _top(self, logits: jax.Array, hot: jax.Array) -> Tuple[jax.Array, jax.Array]:
        """`top_k_logprobs` of the head's logits, the columns mapped to target token ids."""
        lp, idx = top_k_logprobs(logits, self.topk)
        return lp, hot[idx].astype(jnp.int32)

    def _tree_impl(self, param_leaves, kv_caches, node_out, packed, layout, src, g_state, embed, target_head, hot):
        """One tree step of the head (a TARGET_VERIFY forward over the fed forests, see eagle_draft.py): token t
        reads row ``src[t]`` of [g; node_out] (its parent's output: the stored one for the root's children, else the
        step before's), int32[dp * T_pad]. Returns (kv_caches, node_out with this step's outputs in each rank's
        first T_pad rows, float32[dp * T_pad, topk] top-k log-probabilities, int32[dp * T_pad, topk] tokens)."""
        model, fb = self._model_and_batch(param_leaves, packed, layout)
        hidden = jnp.concatenate([g_state, node_out.astype(g_state.dtype)])[src]
        out, kv_caches = model(fb, kv_caches, hidden, embed, project=False)
        at = out[fb.logits_indices]
        lp, tok = self._top(self._gathered(model.draft_logits(at, target_head)), hot)
        t_pad = at.shape[0] // self.dp_size
        node_out = node_out.reshape(self.dp_size, self.tree_rows, -1).at[:, :t_pad].set(
            at.astype(node_out.dtype).reshape(self.dp_size, t_pad, -1)).reshape(node_out.shape)
        return kv_caches, node_out, lp, tok

    def _rows(self, rows: Sequence[np.ndarray], n: int) -> jax.Array:
        """Per rank state rows (rank-local request slots, in token or logits-row order) -> the stacked int32[dp * n]
        of global state rows, padding rows ``num_state_rows`` (nothing written)."""
        out = np.full((self.dp_size, n), self.num_state_rows, np.int32)
        for r, x in enumerate(rows):
            if x is not None and len(x):
                out[r, :len(x)] = np.where(np.asarray(x) < 0, self.num_state_rows,
                                           np.asarray(x) + r * self.num_request_slots)
        return jax.device_put(out.reshape(-1), self._replicated)

    def draft_extend(self, batches: Sequence[Optional[ModelWorkerBatch]], aux: jax.Array,
                     rows: Sequence[Optional[np.ndarray]]) -> None:
        """Dispatch the head over a target step's rows (`batches`: per rank, the step's batch with each token
        replaced by the token after it; None: idle); aux: the target step's features (`StepOutput.aux` or
        ``.hidden``); rows: per rank, int32 per logits row, the request slot whose state that row's result goes to
        (-1: none)."""
        self._dispatch(self._draft_extend, batches, aux, rows)

    def draft_decode(self, batches: Sequence[Optional[ModelWorkerBatch]], slots: Sequence[Optional[np.ndarray]]
                     ) -> np.ndarray:
        """Run one draft step (per rank a DECODE batch of one row per request, None: idle; slots: the rows' request
        slots) and return the state's tokens on the host, int32[dp * num_request_slots] (`tokens`)."""
        self._dispatch(self._draft_decode, batches, None, slots)
        return self.tokens()

    def draft_tree(self, batches: Sequence[Optional[ModelWorkerBatch]], src: Sequence[Optional[np.ndarray]]
                   ) -> Tuple[np.ndarray, np.ndarray]:
        """Run one tree step (top-k > 1; per rank a TARGET_VERIFY batch of the fed forests, None: idle; src: per
        rank, per token, the row its feature comes from: ``-1 - s`` the stored output of rank-local request slot s,
        ``j >= 0`` the step before's output of that rank's token j). Returns on the host (float32[dp * T_pad, topk]
        log-probabilities, int32[dp * T_pad, topk] tokens): each token's k most likely next tokens, best first."""
        stacked = self._step_batch(batches)
        packed, layout = self._forward_inputs(stacked.forward_batch)
        self.kv_caches, self.node_out, lp, tok = self._draft_tree(
            self._param_leaves, self.kv_caches, self.node_out, packed, layout,
            self._tree_src(src, stacked.rows_pad // self.dp_size), self.states[0], self.embed, self.target_head,
            self.hot)
        self._check_no_new_compile(stacked)
        return np.asarray(lp), np.asarray(tok)

    def _tree_src(self, src: Sequence[Optional[np.ndarray]], t_pad: int) -> jax.Array:
        """Per rank `draft_tree` sources -> int32[dp * t_pad] rows of [g; node_out] (padding: row 0)."""
        out = np.zeros((self.dp_size, t_pad), np.int32)
        for r, x in enumerate(src):
            if x is not None and len(x):
                x = np.asarray(x)
                out[r, :len(x)] = np.where(x < 0, -1 - x + r * self.num_request_slots,
                                           self.num_state_rows + r * self.tree_rows + x)
        return jax.device_put(out.reshape(-1), self._replicated)

    def _dispatch(self, program, batches, hidden, rows) -> None:
        """Stack the ranks' batches and dispatch `program` (the draft extend or decode) on them."""
        stacked = self._step_batch(batches)
        packed, layout = self._forward_inputs(stacked.forward_batch)
        self.kv_caches, self.states = program(
            self._param_leaves, self.kv_caches, self.states, packed, layout, hidden,
            self._rows(rows, stacked.rows_pad // self.dp_size), self.embed, self.target_head, self.hot)
        self._check_no_new_compile(stacked)

    def tokens(self) -> np.ndarray:
        """int32[dp * num_request_slots]: each request slot's next draft token (waits for the programs before)."""
        return np.asarray(self.states[1])

    def top_states(self) -> Tuple[np.ndarray, np.ndarray]:
        """(float32, int32)[dp * num_request_slots, topk]: each request slot's k most likely first draft tokens'
        log-probabilities and ids, best first (top-k > 1)."""
        return np.asarray(self.states[3]), np.asarray(self.states[2])

    def warmup_programs(self) -> List[Tuple[str, object]]:
        """The draft extend of every step shape of the target and the draft decode of every DECODE shape; with
        top-k > 1 the tree step and the K/V moves of every verify shape (the head runs no sampling or logprob
        program)."""
        programs = []
        for mode, t, s in self.buckets.all_shapes():
            programs.append((f"draft extend {mode.name.lower()} T={t} S={s}", self._lower(mode, t, s, True)))
            if mode == ForwardMode.DECODE:
                programs.append((f"draft decode T={t} S={s}", self._lower(mode, t, s, False)))
            if mode == ForwardMode.TARGET_VERIFY and self.topk > 1:
                programs.append((f"draft tree T={t} S={s}", self._lower_tree(t, s)))
                programs.append((f"draft KV move M={t}", lower_move(self, t)))
        return programs

    def _lower(self, mode: ForwardMode, t_pad: int, s_pad: int, project: bool):
        """A thunk lowering the draft extend (`project`) or decode program of one padded shape with serving's exact
        inputs."""
        def lower():
            stacked = self._step_batch([self.dummy_batch(mode, t_pad, s_pad)] * self.dp_size)
            packed, layout = self._forward_inputs(stacked.forward_batch)
            rows = self._rows([None] * self.dp_size, stacked.rows_pad // self.dp_size)
            fn = self._draft_extend if project else self._draft_decode
            aux = jax.ShapeDtypeStruct((self.dp_size * t_pad, self.aux_width), self.aux_dtype,
                                       sharding=self._hidden_sharding) if project else None
            return fn.lower(self._param_leaves, self.kv_caches, self.states, packed, layout, aux, rows, self.embed,
                            self.target_head, self.hot)
        return lower

    def _lower_tree(self, t_pad: int, s_pad: int):
        """A thunk lowering the tree step of one verify shape with serving's exact inputs."""
        def lower():
            stacked = self._step_batch([self.dummy_batch(ForwardMode.TARGET_VERIFY, t_pad, s_pad)] * self.dp_size)
            packed, layout = self._forward_inputs(stacked.forward_batch)
            src = self._tree_src([None] * self.dp_size, stacked.rows_pad // self.dp_size)
            return self._draft_tree.lower(self._param_leaves, self.kv_caches, self.node_out, packed, layout, src,
                                          self.states[0], self.embed, self.target_head, self.hot)
        return lower
