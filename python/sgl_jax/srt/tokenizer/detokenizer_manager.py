"""DetokenizerManager process: token ids -> text, incrementally, for every running request.

Incremental decoding keeps two offsets into a request's ids (the approach of vLLM and SGLang's
detokenizers): text is decoded from a "surrounding" offset so that byte-level BPE pieces merge with
their neighbours, and nothing is emitted while the text ends in an incomplete UTF-8 sequence (U+FFFD).
Stop strings: text that could be the start of a stop string is held back until it is decided, and on a
stop-string finish the output is cut before the match (unless no_stop_trim), so the concatenation of
streamed pieces always equals the final text.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Callable, Dict, List

import zmq

from sgl_jax.srt.configs.model_config import load_tokenizer
from sgl_jax.srt import fault_injection
from sgl_jax.srt.io_struct import BatchStrOut, BatchTokenIDOut, DecodeConfig, StrOut, TokenOut
from sgl_jax.srt.utils import configure_logging, prepare_child_process

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


def stop_holdback(text: str, stops: List[str]) -> int:
    """Characters at the end of `text` that could begin a stop string (so must not be emitted yet)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


def text_decoder(tokenizer, config: DecodeConfig) -> Callable[[List[int]], str]:
    """ids -> text as ``tokenizer.decode`` with `config`'s options gives it. For a fast tokenizer that does not
    clean up tokenization spaces that is its Rust tokenizer's ``decode`` alone (a fast tokenizer ignores
    ``spaces_between_special_tokens``), called directly: 0.7 us a call against 3.5 us through transformers'
    wrapper, two calls per request and step (SmolLM2's tokenizer on a 2-core CPU)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    skip = config.skip_special_tokens
    if getattr(tokenizer, "is_fast", False) and backend is not None \
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip)
    spaces = config.spaces_between_special_tokens
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)


class IncrementalDetokenizer:
    """Text of one request's output ids, decoded as they arrive.

    Args:
        tokenizer: an HF tokenizer (``decode``).
        config: skip_special_tokens / spaces_between_special_tokens / stop strings / no_stop_trim.
    """

    def __init__(self, tokenizer, config: DecodeConfig):
        self.tokenizer = tokenizer
        self.config = config
        self._decode = text_decoder(tokenizer, config)
        self.ids: List[int] = []
        self.text = ""  # decoded text of ids[:read_offset]
        self.surr_offset = 0
        self.read_offset = 0
        self.sent = 0  # characters of text already emitted

    def _advance(self, final: bool) -> None:
        surr = self._decode(self.ids[self.surr_offset:self.read_offset])
        full = self._decode(self.ids[self.surr_offset:])
        new = full[len(surr):]
        if new and (final or not new.endswith(REPLACEMENT_CHAR)):
            self.text += new
            self.surr_offset = self.read_offset
            self.read_offset = len(self.ids)

    def add(self, new_ids: List[int], finished_reason: dict | None) -> str:
        """Append ids and return the newly final text (possibly empty)."""
        self.ids.extend(new_ids)
        if finished_reason is not None and not self.config.no_stop_trim and finished_reason.get("type") == "stop" \
                and isinstance(finished_reason.get("matched"), int) and self.ids \
                and self.ids[-1] == finished_reason["matched"]:
            self.ids.pop()  # the matched stop token is not part of the text
            self.read_offset = min(self.read_offset, len(self.ids))
        self._advance(final=finished_reason is not None)
        end = len(self.text)
        stops = self.config.stop
        if finished_reason is not None:
            matched = finished_reason.get("matched") if finished_reason.get("type") == "stop" else None
            if isinstance(matched, str) and not self.config.no_stop_trim:
                idx = self.text.find(matched, self.sent)
                if idx < 0:
                    idx = self.text.find(matched)
                end = max(idx, self.sent) if idx >= 0 else end
        elif stops:
            end -= stop_holdback(self.text, stops)
            for s in stops:
                idx = self.text.find(s, self.sent)
                if idx >= 0:
                    end = min(end, idx)
        end = max(end, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out


class DetokenizerManager:
    """Receives BatchTokenIDOut from the scheduler and sends BatchStrOut to the TokenizerManager.

    A request whose decoding raises fails alone: one ``StrOut(error=...)`` goes out for it (the
    TokenizerManager answers 500 and aborts it), its later outputs are dropped, and its final one is passed
    on without text so the TokenizerManager knows the scheduler released it.
    """

    def __init__(self, server_args, port_args):
        self.tokenizer = load_tokenizer(server_args)
        ctx = zmq.Context(2)
        self.recv_from_scheduler = ctx.socket(zmq.PULL)
        self.recv_from_scheduler.bind(port_args.detokenizer_ipc_name)
        self.send_to_tokenizer = ctx.socket(zmq.PUSH)
        self.send_to_tokenizer.connect(port_args.tokenizer_ipc_name)
        self.states: Dict[str, IncrementalDetokenizer] = {}
        self.failed: set = set()  # rids whose decoding failed, until their final output passes

    def handle(self, batch: BatchTokenIDOut) -> BatchStrOut:
        outs = []
        for t in batch.outs:
            if t.rid in self.failed:
                if t.finished_reason is not None:
                    self.failed.discard(t.rid)
                    outs.append(StrOut(rid=t.rid, text="", new_token_ids=[], finished_reason=t.finished_reason,
                                       prompt_tokens=t.prompt_tokens, completion_tokens=t.completion_tokens,
                                       cached_tokens=t.cached_tokens))
                continue
            try:
                outs.append(self._handle_one(t))
            except Exception as exc:
                self.states.pop(t.rid, None)
                reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                logger.error("Request %s failed, aborted (the others go on): internal error while detokenizing "
                             "the request: %s", t.rid, reason)
                if t.finished_reason is None:
                    self.failed.add(t.rid)
                outs.append(StrOut(rid=t.rid, text="", new_token_ids=[], finished_reason=t.finished_reason,
                                   prompt_tokens=0,
                                   completion_tokens=0, cached_tokens=0,
                                   error=f"internal error while detokenizing the request: {reason}"))
        return BatchStrOut(outs)

    def _handle_one(self, t: TokenOut) -> StrOut:
        fault_injection.check("detokenize", (t.rid,))
        state = self.states.get(t.rid)
        if state is None:
            state = self.states[t.rid] = IncrementalDetokenizer(self.tokenizer, t.decode)
        text = state.add(t.new_token_ids, t.finished_reason)
        if t.finished_reason is not None:
            del self.states[t.rid]
        return StrOut(rid=t.rid, text=text, new_token_ids=t.new_token_ids, finished_reason=t.finished_reason,
                      prompt_tokens=t.prompt_tokens, completion_tokens=t.completion_tokens,
                      cached_tokens=t.cached_tokens, logprobs=t.logprobs, routed_experts=t.routed_experts,
                      spec=t.spec)

    def event_loop(self) -> None:
        while True:
            batch = self.recv_from_scheduler.recv_pyobj()
            self.send_to_tokenizer.send_pyobj(self.handle(batch))


def run_detokenizer_process(server_args, port_args, parent_pid: int) -> None:
    configure_logging(server_args.log_level, "Detokenizer")
    prepare_child_process(parent_pid)
    try:
        DetokenizerManager(server_args, port_args).event_loop()
    except Exception:
        logger.error("Detokenizer process failed:\n%s", traceback.format_exc())
        sys.exit(1)
