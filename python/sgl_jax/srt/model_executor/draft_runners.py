"""The runners of speculative decoding's draft models: their weights, their K/V buffers (in the target's slots) and
only the programs they run.

`DraftModelRunner` (STANDALONE's draft model): the forward of every step shape (it runs every target step, logits
unused) and the sampling of DECODE shapes (its own greedy draft steps); no logprob, penalty or K/V-move program.

`EagleRunner`, an EAGLE head's (EAGLE: models/llama_eagle.py, EAGLE-3: models/llama_eagle3.py), with one layer of
K/V buffers and two programs of its own:

- **draft extend** (after every target step): the head runs over the step's rows, each fed the token after its
  position and the target's features there (EAGLE-3: the aux hidden states of three layers; EAGLE: the final
  hidden states); at each row `rows` names, its output and the draft token it predicts are stored in the request
  slot's state (``g_state``, ``tok_state``).
- **draft decode** (each draft step): one row per request, fed a chain token and its slot's stored output; both
  states are overwritten with the new output and token.

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
from sgl_jax.srt.model_loader.loader import JNP_DTYPES


class DraftModelRunner(ModelRunner):
    """A `ModelRunner` of STANDALONE's draft model (see the module docstring); the same arguments.
    ``draft_trees``: set when it drafts top-k trees (its K/V then moves with an accepted path off the first
    branch: the K/V move programs are compiled too)."""

    draft_trees = False

    def warmup_programs(self) -> List[Tuple[str, object]]:
        """Every step shape's forward, the sampling of DECODE shapes, and with `draft_trees` the K/V moves of
        each verify shape."""
        shapes = self.buckets.all_shapes()
        programs = [(f"draft {mode.name.lower()} T={t} S={s}", self._lower_step(mode, t, s)) for mode, t, s in shapes]
        rows = sorted({s for mode, _, s in shapes if mode == ForwardMode.DECODE})
        programs += [(f"draft sampling S={s}", self._lower_sample(s)) for s in rows]
        if self.draft_trees:
            programs += [(f"draft KV move M={t}", self._lower_move(t)) for mode, t, _ in shapes
                         if mode == ForwardMode.TARGET_VERIFY]
        return programs


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
    """

    def __init__(self, server_args, model_config, *, buckets, max_context_len: int, kv_spec_fn,
                 num_request_slots: int, embed: jax.Array, target_head: jax.Array, hot: np.ndarray,
                 aux_width: int, aux_dtype):
        super().__init__(server_args, model_config, buckets=buckets, max_context_len=max_context_len,
                         kv_spec_fn=kv_spec_fn, num_request_slots=num_request_slots)
        r = self._replicated
        self.embed, self.target_head = embed, target_head
        self.hot = jax.device_put(np.asarray(hot, np.int32), r)
        self.aux_width, self.aux_dtype = int(aux_width), jnp.dtype(aux_dtype)
        self.num_state_rows = self.dp_size * num_request_slots
        dtype = JNP_DTYPES[model_config.dtype]
        self.g_state = jax.jit(lambda: jnp.zeros((self.num_state_rows, model_config.hidden_size), dtype),
                               out_shardings=r)()
        self.tok_state = jax.jit(lambda: jnp.zeros((self.num_state_rows,), jnp.int32), out_shardings=r)()
        out = (self._kv_sharding, r, r)
        self._draft_extend = jax.jit(functools.partial(self._draft_impl, project=True), donate_argnums=(1, 2, 3),
                                     static_argnums=(5,), out_shardings=out)
        self._draft_decode = jax.jit(functools.partial(self._draft_impl, project=False), donate_argnums=(1, 2, 3),
                                     static_argnums=(5,), out_shardings=out)

    def _draft_impl(self, param_leaves, kv_caches, g_state, tok_state, packed, layout, hidden, rows, embed,
                    target_head, hot, *, project: bool):
        """One head forward. hidden: [dp * T_pad, aux_width] the target's features (`project`), else
        ignored: each token reads its request's stored output ``g_state[rows]``; rows: int32[dp * T_pad] (decode)
        or int32[dp * R_pad] (extend, per logits row), the state row each token's (row's) result is written to,
        ``num_state_rows`` to write nothing (and to read row 0). Returns (kv_caches, g_state, tok_state)."""
        params = jax.tree.unflatten(self._param_treedef, param_leaves)
        fb = unpack(packed, layout)
        fb = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self._rank_rows), fb)
        fb = dataclasses.replace(fb, attention_backend=self.attention_backend)
        model = nnx.merge(self.graphdef, params)
        if not project:
            hidden = g_state[jnp.minimum(rows, self.num_state_rows - 1)]
        out, kv_caches = model(fb, kv_caches, hidden, embed, project=project)
        at = out[fb.logits_indices]
        tok = hot[jnp.argmax(self._gathered(model.draft_logits(at, target_head)), axis=-1)].astype(jnp.int32)
        g_state = g_state.at[rows].set(at.astype(g_state.dtype), mode="drop")
        tok_state = tok_state.at[rows].set(tok, mode="drop")
        return kv_caches, g_state, tok_state

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

    def _dispatch(self, program, batches, hidden, rows) -> None:
        """Stack the ranks' batches and dispatch `program` (the draft extend or decode) on them."""
        stacked = self._step_batch(batches)
        packed, layout = self._forward_inputs(stacked.forward_batch)
        self.kv_caches, self.g_state, self.tok_state = program(
            self._param_leaves, self.kv_caches, self.g_state, self.tok_state, packed, layout, hidden,
            self._rows(rows, stacked.rows_pad // self.dp_size), self.embed, self.target_head, self.hot)
        self._check_no_new_compile(stacked)

    def tokens(self) -> np.ndarray:
        """int32[dp * num_request_slots]: each request slot's next draft token (waits for the programs before)."""
        return np.asarray(self.tok_state)

    def warmup_programs(self) -> List[Tuple[str, object]]:
        """The draft extend of every step shape of the target and the draft decode of every DECODE shape (the
        head runs no sampling, logprob or K/V move program)."""
        programs = []
        for mode, t, s in self.buckets.all_shapes():
            programs.append((f"draft extend {mode.name.lower()} T={t} S={s}", self._lower(mode, t, s, True)))
            if mode == ForwardMode.DECODE:
                programs.append((f"draft decode T={t} S={s}", self._lower(mode, t, s, False)))
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
            return fn.lower(self._param_leaves, self.kv_caches, self.g_state, self.tok_state, packed, layout, aux,
                            rows, self.embed, self.target_head, self.hot)
        return lower
