"""Per-request-slot state on the device: what a decode step reads there instead of receiving it from the host.

A decode step needs, per sequence, its page-table row (``pages_per_seq`` entries), its sampling parameters and its
input token. Sent every step they cost host time and a host-to-device copy that grows with the context (64
sequences of an 8,192-token context at page size 1: 2 MiB a step). Here they stay on the device, in rows indexed by
stacked request slot like the penalty state (rank r's ReqToTokenPool row s is ``r * slots_per_rank + s``):

- every step whose inputs the host lays out in full (an extend, a mixed chunk, a decode step of a host-built batch)
  writes its sequences' page-table rows and its sampling rows' parameters (`write_rows`);
- a decode step of `forward_batch.DecodeRows` adds the one page-table entry of each row's new token and reads the
  rest (`decode_inputs`); its input tokens come from the future-token buffer (model_executor/future_tokens.py),
  which every sampling step writes.

Every write is of an absolute value (a row, never an increment), so re-running a step -- the scheduler's fault
isolation -- leaves the state as one run does. Only KV specs of one pool use it (a hybrid sliding-window pool's
page translation changes between steps on the host: those servers keep host-built decode steps).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.forward_batch import DecodeRows, ForwardBatch, ForwardMode
from sgl_jax.srt.sampling.sampling_batch import STOP_IDS_WIDTH, SamplingBatch
from sgl_jax.srt.sampling.sampling_params import device_rows


def _columns() -> Dict[str, Tuple[int, np.dtype, object]]:
    """The per-slot table's columns: name -> (first column, dtype, padding value); the SamplingParams device rows
    (`device_rows`), then seeds, penalized, min_new_tokens, ignore_eos, stop_ids (STOP_IDS_WIDTH columns) and
    lora. float32 values are stored bit for bit, bools as 0/1."""
    cols, c = {}, 0
    specs = [(name, spec.dtype, spec.pad, 1) for name, spec in device_rows().items()]
    specs += [("seeds", np.dtype(np.int32), 0, 1), ("penalized", np.dtype(np.bool_), False, 1),
              ("min_new_tokens", np.dtype(np.int32), 0, 1), ("ignore_eos", np.dtype(np.bool_), False, 1),
              ("stop_ids", np.dtype(np.int32), -1, STOP_IDS_WIDTH), ("lora", np.dtype(np.int32), -1, 1)]
    for name, dtype, pad, width in specs:
        cols[name] = (c, np.dtype(dtype), pad, width)
        c += width
    return cols


COLUMNS = _columns()
NUM_COLUMNS = sum(w for _, _, _, w in COLUMNS.values())


def _encode(x: jax.Array, dtype) -> jax.Array:
    """A column's values as the table's int32 (traced)."""
    if dtype == np.float32:
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return x.astype(jnp.int32)


def _decode(x: jax.Array, dtype) -> jax.Array:
    """int32 table values back as the column's dtype (traced)."""
    if dtype == np.float32:
        return jax.lax.bitcast_convert_type(x, jnp.float32)
    if dtype == np.bool_:
        return x != 0
    return x


@dataclasses.dataclass
class SlotState:
    """R request slots' decode state (R = dp * slots per rank), in two arrays so that a step takes few arguments.

    page_table: int32[R, pages_per_seq] the KV page of every page-sized span of the slot's sequence (entries past
        its KV length are stale: never read).
    table: int32[R, NUM_COLUMNS] the slot's request constants by `COLUMNS`: the SamplingParams device rows
        (temperature, top_p, ... as `device_rows`), seeds, penalized, min_new_tokens, ignore_eos, stop_ids (-1
        padded) -- see SamplingBatch -- and lora (the slot's adapter slot, -1: none).
    """

    page_table: jax.Array
    table: jax.Array

    def column(self, name: str, rows: jax.Array) -> jax.Array:
        """Column `name` of the slots `rows` (int32[n]) in its dtype: [n] (stop_ids: [n, STOP_IDS_WIDTH])."""
        c, dtype, _, width = COLUMNS[name]
        x = _decode(self.table[rows, c:c + width], dtype)
        return x if width > 1 else x[:, 0]


jax.tree_util.register_dataclass(SlotState)


def new_slot_state(num_slots: int, pages_per_seq: int) -> SlotState:
    """The state of `num_slots` slots: page tables zero, every column at its padding value; bytes: num_slots * 4 *
    (pages_per_seq + NUM_COLUMNS)."""
    row = jnp.concatenate([_encode(jnp.full((width,), pad, dtype), dtype)
                           for _, dtype, pad, width in COLUMNS.values()])
    return SlotState(page_table=jnp.zeros((num_slots, pages_per_seq), jnp.int32),
                     table=jnp.tile(row[None], (num_slots, 1)))


def _real_rows(num_seqs: jax.Array, n: int) -> Tuple[jax.Array, jax.Array, int]:
    """(bool[n] whether row i is a real row of its rank, int32[n] its index inside its rank, rows per rank) for n
    rank-stacked rows and int32[D] real rows per rank."""
    s_pad = n // num_seqs.shape[0]
    i = jnp.arange(n, dtype=jnp.int32)
    local = i % s_pad
    return local < num_seqs[i // s_pad], local, s_pad


def write_rows(state: SlotState, fb: ForwardBatch, sampling: SamplingBatch) -> SlotState:
    """`state` with the rows of a host-built step written (traced): every real sequence's page-table row, and
    the constants of every row that samples. EXTEND and DECODE steps only (a sampling row is a sequence); a
    TARGET_VERIFY step leaves the state as it is."""
    if fb.forward_mode == ForwardMode.TARGET_VERIFY:
        return state
    R = state.page_table.shape[0]
    real, _, _ = _real_rows(jnp.reshape(fb.num_seqs, (-1,)), sampling.slots.shape[0])
    page_table = state.page_table.at[jnp.where(real, sampling.slots, R)].set(fb.page_indices, mode="drop")
    values = {**sampling.params, "seeds": sampling.seeds, "penalized": sampling.penalized,
              "min_new_tokens": sampling.min_new_tokens, "ignore_eos": sampling.ignore_eos,
              "stop_ids": sampling.stop_ids}
    n = sampling.slots.shape[0]
    values["lora"] = (fb.lora_ids[fb.logits_indices] if fb.lora_ids is not None
                      else jnp.full((n,), -1, jnp.int32))
    cols = [_encode(jnp.reshape(values[name], (n, width)), dtype) for name, (_, dtype, _, width) in COLUMNS.items()]
    rows = jnp.where(real & sampling.writes_future, sampling.slots, R)
    table = state.table.at[rows].set(jnp.concatenate(cols, axis=1), mode="drop")
    return SlotState(page_table=page_table, table=table)


def decode_inputs(state: SlotState, rows: DecodeRows, input_ids: jax.Array, k, live: jax.Array, page_size: int,
                  with_lora: bool) -> Tuple[ForwardBatch, SamplingBatch, SlotState]:
    """Step k of a slot decode (traced): its ForwardBatch and SamplingBatch (vocab mask left None) as
    `ScheduleBatch.build_model_worker_batch` + `stack_ranks` would lay them out for the same rows, and `state` with
    the page-table entry of each live row's new token written.

    Args:
        input_ids: int32[n] each row's input token (the future buffer's, or the token step k - 1 sampled).
        k: the step's index among the K (traced or static).
        live: bool[n] the rows that take step k (real, not stopped, a KV slot given for it); the other rows run
            as padding rows do (their KV goes to the padding sink, nothing of theirs is written).
        page_size: tokens per KV page; with_lora: whether the model takes per-token adapter slots.
    """
    n = rows.slots.shape[0]
    D = rows.num_seqs.shape[0]
    real, local, s_pad = _real_rows(rows.num_seqs, n)
    R = state.page_table.shape[0]
    kv = jnp.where(live, rows.kv_slots[k], 0)
    pos = rows.positions + k
    page_table = state.page_table.at[jnp.where(live, rows.slots, R), pos // page_size].set(kv // page_size,
                                                                                       mode="drop")
    state = dataclasses.replace(state, page_table=page_table)
    page_indices = jnp.where(real[:, None], page_table[rows.slots], 0)
    ranks_cu = [jnp.minimum(jnp.arange(s_pad + 1, dtype=jnp.int32), rows.num_seqs[r]) for r in range(D)]
    fb = ForwardBatch(
        input_ids=jnp.where(real, input_ids, 0), positions=jnp.where(real, pos, 0), out_cache_loc=kv,
        cu_q_lens=jnp.concatenate(ranks_cu), kv_lens=jnp.where(real, pos + 1, 0), page_indices=page_indices,
        num_seqs=rows.num_seqs, logits_indices=jnp.where(real, local, 0) + (jnp.arange(n) // s_pad) * s_pad,
        prefix_lens=jnp.zeros((n,), jnp.int32), segment_starts=jnp.zeros((n,), jnp.int32),
        shared_prefix_len=jnp.zeros((D,), jnp.int32),
        lora_ids=jnp.where(live, state.column("lora", rows.slots), -1) if with_lora else None,
        forward_mode=ForwardMode.DECODE)
    steps = rows.steps + k
    col = lambda name: state.column(name, rows.slots)  # noqa: E731
    params = {name: jnp.where(live, col(name), jnp.asarray(spec.pad, spec.dtype))
              for name, spec in device_rows().items()}
    min_new = col("min_new_tokens")
    sampling = SamplingBatch(
        params=params, seeds=col("seeds"), steps=steps, suppress_eos=live & (steps < min_new),
        slots=rows.slots, penalized=live & col("penalized"), last_token=fb.input_ids,
        writes_future=live, last_token_index=jnp.where(live, steps - 1, -1), constrained=live & rows.constrained,
        min_new_tokens=min_new, ignore_eos=col("ignore_eos"), stop_ids=col("stop_ids"))
    return fb, sampling, state


def stops(sampling: SamplingBatch, next_ids: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """bool[n]: the rows whose sampled token ends their request by a stop token (`Req.check_finished`'s token
    rules: a stop id among the first STOP_IDS_WIDTH, or an EOS id unless ignore_eos; none before min_new_tokens
    outputs). A multi-step decode stops such rows on device; the host checks every rule (stop strings too)."""
    outputs = sampling.steps + 1
    hit = jnp.any(next_ids[:, None] == sampling.stop_ids, axis=-1)
    hit |= ~sampling.ignore_eos & jnp.any(next_ids[:, None] == eos_ids[None, :], axis=-1)
    return hit & (outputs >= sampling.min_new_tokens)


def padding_rows(s_pad: int, dp: int, num_steps: int = 1) -> DecodeRows:
    """All-padding DecodeRows of `dp` ranks (warm-up)."""
    return DecodeRows.stack([DecodeRows.padding(s_pad, num_steps)] * dp, 0)

