"""Grammar-constrained decoding with llguidance (https://github.com/guidance-ai/llguidance).

The flow follows SGLang's: a request that carries ``json_schema``, ``regex`` or ``ebnf`` is validated at the
edge (`validate_grammar`, HTTP 400 for a malformed grammar), its grammar is compiled off the scheduler loop
in a worker thread (`GrammarBackend.submit`, a cache keyed by the grammar) while the request waits in the
scheduler's grammar queue, and each step the request's `Grammar` fills its row of a packed vocabulary
bitmask (int32[S, ceil(V / 32)], bit v of word v // 32 set = token v allowed; llguidance's layout, the same
as xgrammar's) that the compiled sampling step applies (`layers/sampler.py`). The sampled token is then fed
back (`Grammar.accept_token`); the request finishes when the grammar cannot go on (`is_terminated`).

llguidance was chosen over xgrammar (SGLang's default) because it needs no torch at serve time; it builds
masks lazily with an Earley parser, so compiling a grammar takes milliseconds.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from typing import Dict, Optional, Tuple

import numpy as np

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
# JSON layout of json_schema output: one space after ',' and ':' and no other whitespace. llguidance's default
# (any whitespace between tokens) lets a sampled model emit newlines until max_tokens, leaving the JSON
# unfinished; SGLang offers the same choice (--constrained-json-disable-any-whitespace).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def grammar_spec(sampling_params) -> Optional[Tuple[str, str]]:
    """The request's grammar as (kind, text), kind one of GRAMMAR_KINDS; None when it has none.

    Raises:
        ValueError: more than one of json_schema, regex and ebnf is set (SGLang allows one).
    """
    given = [(k, getattr(sampling_params, k)) for k in GRAMMAR_KINDS if getattr(sampling_params, k) is not None]
    if len(given) > 1:
        raise ValueError(f"Only one of json_schema, regex and ebnf may be given, got {[k for k, _ in given]}")
    return given[0] if given else None


def to_llguidance(kind: str, text: str) -> str:
    """llguidance's grammar string for a request grammar.

    json_schema: a JSON Schema document as a string (OpenAI's ``response_format`` schemas; json_object mode is
    the schema ``{"type": "object"}``); regex: a regular expression the whole output must match; ebnf: a GBNF
    (llama.cpp / xgrammar style, ``root ::= ...``) or Lark grammar.

    Raises:
        ValueError: json_schema that is not a JSON object.
    """
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"json_schema is not supported: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "ebnf":
        try:
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
        except Exception as e:  # the GBNF converter raises plain exceptions on syntax errors
            raise ValueError(f"ebnf is not a valid grammar: {e}") from None
    raise ValueError(f"unknown grammar kind {kind!r}")


def validate_grammar(kind: str, text: str) -> None:
    """Check a request grammar without a tokenizer (milliseconds; runs in the TokenizerManager).

    Raises:
        ValueError: the grammar does not compile; the message names the field and llguidance's reason.
    """
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(to_llguidance(kind, text))
    if error and not error.startswith("WARNING"):
        raise ValueError(f"Invalid {kind}: {' '.join(error.split())[:500]}")


class Grammar:
    """One request's grammar state (an llguidance matcher) while it decodes.

    Args:
        matcher: a fresh ``llguidance.LLMatcher`` owned by this request.
        mask_width: int32 words per row of the step's vocabulary bitmask (ceil(model vocab / 32)).
        kind: the request field the grammar came from (GRAMMAR_KINDS: json_schema, regex or ebnf).
    """

    def __init__(self, matcher, mask_width: int, tokenizer_mask_width: int, kind: str):
        self.matcher = matcher
        self.kind = kind
        self.mask_width = mask_width
        self._tokenizer_mask_width = tokenizer_mask_width

    def fill_vocab_mask(self, vocab_mask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``vocab_mask[row]`` (int32[S, mask_width]); tokens beyond the
        tokenizer's vocabulary (embedding padding) stay disallowed."""
        import llguidance.numpy

        if self._tokenizer_mask_width == vocab_mask.shape[1]:
            llguidance.numpy.fill_next_token_bitmask(self.matcher, vocab_mask, row)
            return
        own = np.zeros((1, self._tokenizer_mask_width), np.int32)
        llguidance.numpy.fill_next_token_bitmask(self.matcher, own, 0)
        n = min(own.shape[1], vocab_mask.shape[1])
        vocab_mask[row] = 0
        vocab_mask[row, :n] = own[0, :n]

    def accept_token(self, token: int) -> bool:
        """Advance past a sampled token; False when the grammar rejects it (the matcher is then in error)."""
        return bool(self.matcher.consume_token(token))

    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token (the request finishes)."""
        return bool(self.matcher.is_stopped())

    def error(self) -> Optional[str]:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarBackend:
    """Compiles request grammars in one worker thread, with a cache keyed by (kind, text).

    Args:
        tokenizer: the server's HF fast tokenizer (wrapped once into an llguidance tokenizer, ~0.5 s, in the
            worker thread).
        vocab_size: the model's vocabulary (logits width, may exceed the tokenizer's).
    """

    def __init__(self, tokenizer, vocab_size: int):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.mask_width = -(-vocab_size // 32)
        self._ll_tokenizer = None
        self._cache: Dict[Tuple[str, str], object] = {}
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer)
        return self._ll_tokenizer

    def _compile(self, kind: str, text: str) -> Grammar:
        import llguidance

        key = (kind, text)
        with self._lock:
            template = self._cache.pop(key, None)
            if template is not None:
                self._cache[key] = template  # most recently used last
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer(), to_llguidance(kind, text), log_level=0)
            if template.is_error():
                raise ValueError(f"Invalid {kind}: {' '.join(template.get_error().split())[:500]}")
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.pop(next(iter(self._cache)))
        return Grammar(template.deep_copy(), self.mask_width, -(-self._tokenizer().vocab_size // 32), kind)

    def submit(self, kind: str, text: str) -> "concurrent.futures.Future[Grammar]":
        """Compile (or take from the cache) off the caller's thread; the future raises ValueError for a
        grammar llguidance rejects."""
        return self._executor.submit(self._compile, kind, text)

    def warmup(self) -> "concurrent.futures.Future":
        """Start building the llguidance tokenizer now (start-up) instead of on the first structured request, on the
        backend's thread; the returned future is done when it is built (the scheduler waits for it after the model's
        warm-up, which it overlaps)."""
        return self._executor.submit(self._tokenizer)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
