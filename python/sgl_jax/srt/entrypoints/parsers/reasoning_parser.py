"""The thinking part of chat output, split off into ``reasoning_content`` (SGLang's ``--reasoning-parser``).

Formats (SGLang's parser names; both use the tags ``<think>`` and ``</think>``):

- ``deepseek-r1``: ``(<think>)*REASONING</think>CONTENT``. DeepSeek-R1's chat template ends the generation
  prompt with ``<think>\\n``, so the output starts inside the thinking part: reasoning is *forced*, everything
  up to the first ``</think>`` is reasoning. DeepSeek-R1-0528 repeats the opening tag; leading ``<think>``
  tags are dropped.
- ``qwen3``: ``<think>REASONING</think>CONTENT``. Qwen3's template leaves the opening tag to the model, so the
  output is reasoning only when it *starts* with ``<think>``; any other output is content as it is. A
  request whose ``chat_template_kwargs`` (after ``reasoning_effort``: see serving_chat.chat_template_kwargs)
  set ``enable_thinking`` to false renders Qwen3's template without thinking: nothing of its output is
  reasoning (`thinking_disabled`). As SGLang's Qwen3Detector, a ``<tool_call>`` inside the thinking part
  ends it (Qwen3.5 sometimes opens a call without closing ``</think>``): the call stays in the content, for
  the tool-call parser.

Upstream behaviour followed (python/sglang/srt/parser/reasoning_parser.py, ``BaseReasoningFormatDetector``):

- the first end tag ends the reasoning; everything after it (later tags included) is content;
- no whitespace is stripped: ``<think>\\nA\\n</think>\\n\\nB`` gives reasoning ``"\\nA\\n"`` and content
  ``"\\n\\nB"`` (SGLang's current parser; its first versions stripped);
- an output that ends inside the thinking part (cut by ``max_tokens``) is all reasoning, with empty content;
- streaming, ``stream_reasoning`` true sends reasoning as it comes; false holds it back and sends it in one
  piece when the end tag arrives or the stream ends (SGLang's ``finish`` flush);
- with ``continue_final_message``, the continued assistant message decides where the output starts
  (SGLang's ``previous_content``): after an end tag in it, the output is content; after an opening tag
  alone, it is reasoning.

Where this differs from upstream on purpose: a tag split across stream chunks at any position is recognised
(SGLang holds back a chunk only while the whole buffer is a tag prefix, so ``"abc</th"`` + ``"ink>"`` leaks the
tag), and the non-forced ``qwen3`` parser treats ``<think>`` only at the very start of the output as an
opening tag (SGLang's one-shot parse also splits on one in the middle, which its stream parse does not):
the two entry points always agree -- concatenating the stream deltas (and `parse_stream_end`) gives
exactly `parse_non_stream`. SGLang's serving also forces the ``qwen3`` parser unless ``enable_thinking`` is
false (for Qwen3-*-Thinking-2507, whose template opens the tag); here that output is content unless it opens
the tag itself.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Type

THINK_START = "<think>"
THINK_END = "</think>"

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ReasoningDetector:
    """Splits one choice's output into (reasoning, content), in one piece (`parse_non_stream`) or as it streams
    (`parse_stream_chunk`, then `parse_stream_end`). One detector per choice: the stream methods keep state.

    Args:
        think_start_token / think_end_token: the tags around the thinking part.
        force_reasoning: the output starts inside the thinking part (the template opened it); otherwise it is
            reasoning only if it starts with think_start_token.
        stream_reasoning: stream reasoning as it comes (true) or send it in one piece when it ends (false).
        tool_start_token: a tag that also ends the thinking part and stays in the content (a tool call).
        previous_content: with continue_final_message, the assistant message the output continues.
    """

    def __init__(self, think_start_token: str = THINK_START, think_end_token: str = THINK_END,
                 force_reasoning: bool = False, stream_reasoning: bool = True,
                 tool_start_token: Optional[str] = None, previous_content: str = ""):
        self.think_start_token = think_start_token
        self.think_end_token = think_end_token
        self.force_reasoning = force_reasoning
        self.stream_reasoning = stream_reasoning
        self.tool_start_token = tool_start_token
        self._ends = tuple(t for t in (think_end_token, tool_start_token) if t)
        self._state = _REASONING if force_reasoning else _START
        if think_end_token in previous_content:
            self._state = _CONTENT
        elif think_start_token in previous_content:
            self._state = _REASONING
        self._at_start = True  # leading opening tags are still to be dropped
        self._buffer = ""  # text held back: a possible tag prefix
        self._held_reasoning = ""  # reasoning not sent yet (stream_reasoning false)

    @property
    def in_reasoning(self) -> bool:
        """Whether the output seen so far ends inside the thinking part."""
        return self._state == _REASONING

    def _end_marker(self, text: str) -> Tuple[int, str]:
        """The first end marker in `text`: (index, marker), or (-1, "")."""
        best = (-1, "")
        for m in self._ends:
            i = text.find(m)
            if i >= 0 and (best[0] < 0 or i < best[0]):
                best = (i, m)
        return best

    def _held_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper prefix of an end marker (held back)."""
        for k in range(min(len(text), max(len(m) for m in self._ends) - 1), 0, -1):
            if any(m.startswith(text[-k:]) for m in self._ends):
                return k
        return 0

    def _reasoning_out(self, piece: str, done: bool) -> str:
        if self.stream_reasoning:
            return piece
        self._held_reasoning += piece
        if not done:
            return ""
        out, self._held_reasoning = self._held_reasoning, ""
        return out

    def parse_stream_chunk(self, delta: str) -> Tuple[str, str]:
        """The next piece of output -> (reasoning delta, content delta), either possibly empty. Text that may
        be the beginning of a tag is held back until the next chunk (or `parse_stream_end`) decides."""
        buf = self._buffer + delta
        reasoning, content = "", ""
        while True:
            if self._state == _START:
                if buf.startswith(self.think_start_token):
                    buf = buf[len(self.think_start_token):]
                    self._state = _REASONING
                    continue
                if self.think_start_token.startswith(buf):  # "" or a prefix of the tag: wait
                    break
                self._state = _CONTENT
                continue
            if self._state == _REASONING:
                if self._at_start:
                    if buf.startswith(self.think_start_token):
                        buf = buf[len(self.think_start_token):]
                        continue
                    if self.think_start_token.startswith(buf):
                        break
                    self._at_start = False
                i, marker = self._end_marker(buf)
                if i >= 0:
                    reasoning += self._reasoning_out(buf[:i], done=True)
                    buf = buf[i + len(marker):] if marker == self.think_end_token else buf[i:]
                    self._state = _CONTENT
                    continue
                keep = self._held_suffix(buf)
                reasoning += self._reasoning_out(buf[:len(buf) - keep], done=False)
                buf = buf[len(buf) - keep:]
                break
            content += buf
            buf = ""
            break
        self._buffer = buf
        return reasoning, content

    def parse_stream_end(self) -> Tuple[str, str]:
        """The end of the output -> (reasoning, content) still held back: inside the thinking part, the rest of
        the reasoning (an end tag never came); before the output was known to open it, content."""
        buf, self._buffer = self._buffer, ""
        if self._state == _REASONING:
            return self._reasoning_out(buf, done=True), ""
        return "", buf

    def parse_non_stream(self, text: str) -> Tuple[str, str]:
        """A whole output -> (reasoning, content); reasoning is "" when there is none."""
        r1, c1 = self.parse_stream_chunk(text)
        r2, c2 = self.parse_stream_end()
        return r1 + r2, c1 + c2


class DeepSeekR1Detector(ReasoningDetector):
    """``deepseek-r1``: a new assistant turn starts inside the thinking part (its template opens it); see the
    module doc. `force_reasoning` false (no generation prompt: a continued message, or add_generation_prompt
    false) leaves it to `previous_content` and the output's own opening tag."""

    def __init__(self, stream_reasoning: bool = True, previous_content: str = "", force_reasoning: bool = True):
        super().__init__(THINK_START, THINK_END, force_reasoning=force_reasoning, stream_reasoning=stream_reasoning,
                         previous_content=previous_content)


class Qwen3Detector(ReasoningDetector):
    """``qwen3``: reasoning when the output starts with ``<think>``; ``<tool_call>`` also ends it."""

    def __init__(self, stream_reasoning: bool = True, previous_content: str = "", force_reasoning: bool = False):
        super().__init__(THINK_START, THINK_END, force_reasoning=force_reasoning, stream_reasoning=stream_reasoning,
                         tool_start_token="<tool_call>", previous_content=previous_content)


DETECTORS: Dict[str, Type[ReasoningDetector]] = {"deepseek-r1": DeepSeekR1Detector, "qwen3": Qwen3Detector}


def thinking_disabled(parser_name: str, template_kwargs: Optional[dict]) -> bool:
    """Whether the chat template renders without a thinking part, so that nothing of the output is
    reasoning: ``qwen3`` with ``enable_thinking`` false (SGLang's rule for Qwen3's switch)."""
    return parser_name == "qwen3" and (template_kwargs or {}).get("enable_thinking", True) is False


def get_detector(parser_name: str, *, stream_reasoning: bool = True, template_kwargs: Optional[dict] = None,
                 previous_content: str = "", new_turn: bool = True) -> Optional[ReasoningDetector]:
    """A fresh detector for one choice of a request, or None when the request's template has no thinking part
    (`thinking_disabled`).

    Args:
        parser_name: ``--reasoning-parser`` (a key of DETECTORS).
        stream_reasoning: the request's ``stream_reasoning``.
        template_kwargs: the variables the chat template rendered with (``enable_thinking``).
        previous_content: with continue_final_message, the assistant message the output continues.
        new_turn: the prompt ends with the template's generation prompt (a new assistant turn); false with
            continue_final_message or add_generation_prompt false, where deepseek-r1's template opened no
            thinking part, so its output is not forced into one.

    Raises:
        ValueError: an unknown parser name.
    """
    cls = DETECTORS.get(parser_name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {parser_name!r}; choose one of {sorted(DETECTORS)}")
    if thinking_disabled(parser_name, template_kwargs):
        return None
    if cls is DeepSeekR1Detector:
        return cls(stream_reasoning=stream_reasoning, previous_content=previous_content, force_reasoning=new_turn)
    return cls(stream_reasoning=stream_reasoning, previous_content=previous_content)
