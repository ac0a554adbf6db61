"""Per-request sampling parameters (SGLang's `SamplingParams` names and defaults)."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Union

TOP_LOGPROBS_MAX = 20


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request and when to stop.

    max_new_tokens: tokens to generate at most (None: up to the context length).
    min_new_tokens: EOS is masked and stop conditions are ignored until this many tokens exist.
    stop: stop strings (the output is cut before the first match unless no_stop_trim).
    stop_token_ids: extra token ids that end generation.
    temperature: 0 for greedy. top_p in (0, 1]. top_k: -1 (or 0) disables. min_p in [0, 1].
    ignore_eos: keep generating past EOS. sampling_seed: per-request seed (also accepted as ``seed``).
    """

    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "SamplingParams":
        """Build from a request's ``sampling_params`` object.

        Raises:
            ValueError: unknown keys or wrongly typed values (reported as HTTP 400).
        """
        d = dict(d or {})
        if "seed" in d and "sampling_seed" not in d:
            d["sampling_seed"] = d.pop("seed")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Unknown sampling parameters: {unknown}")
        p = cls(**d)
        p._check_types()
        return p

    def _check_types(self) -> None:
        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            if not is_num(getattr(self, name)):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        for name in ("min_new_tokens", "top_k", "n"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int)
                                                or isinstance(self.max_new_tokens, bool)):
            raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.sampling_seed is not None and not isinstance(self.sampling_seed, int):
            raise ValueError(f"sampling_seed must be an integer, got {self.sampling_seed!r}")
        if self.stop is not None and not (isinstance(self.stop, str) or (
                isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop))):
            raise ValueError("stop must be a string or a list of strings")
        if self.stop_token_ids is not None and not (isinstance(self.stop_token_ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids)):
            raise ValueError("stop_token_ids must be a list of integers")

    def verify(self, vocab_size: int) -> None:
        """Check value ranges. Raises ValueError naming the parameter."""
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be non-negative, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be non-negative, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens "
                             f"({self.max_new_tokens})")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0:
            raise ValueError("frequency_penalty, presence_penalty and repetition_penalty are not supported yet")
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entry {t} is outside the vocabulary [0, {vocab_size})")

    def normalize(self) -> None:
        """Canonical forms: stop as a list, top_k 0 -> -1, greedy when temperature is ~0."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.temperature < 1e-6:
            self.temperature = 0.0
