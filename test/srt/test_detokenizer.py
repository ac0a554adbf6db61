"""Incremental detokenization with the real SmolLM2 tokenizer: UTF-8 safety and stop strings."""

import pytest

from sgl_jax.srt.tokenizer.detokenizer_manager import IncrementalDetokenizer, stop_holdback
from sgl_jax.srt.io_struct import DecodeConfig

TEXT = "Café au lait ☕, 日本語のテキスト, emoji 🎉🚀 and ½ — done."


def stream(tok, ids, config, finish=None):
    d = IncrementalDetokenizer(tok, config)
    pieces = [d.add([t], None) for t in ids[:-1]]
    pieces.append(d.add([ids[-1]], finish))
    return pieces


def test_multibyte_text_streams_exactly(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(TEXT)
    assert len(ids) > 20
    # the byte-level vocabulary splits some characters across tokens
    assert any("\ufffd" in smollm2_tokenizer.decode([t]) for t in ids)
    pieces = stream(smollm2_tokenizer, ids, DecodeConfig())
    assert "".join(pieces) == smollm2_tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_is_held_back_and_trimmed(smollm2_tokenizer):
    text = "The answer is 42. STOP here and more"
    ids = smollm2_tokenizer.encode(text)
    upto = next(i for i in range(len(ids)) if "STOP" in smollm2_tokenizer.decode(ids[:i + 1]))
    pieces = stream(smollm2_tokenizer, ids[:upto + 1], DecodeConfig(stop=["STOP"]),
                    finish={"type": "stop", "matched": "STOP"})
    assert "".join(pieces) == "The answer is 42. "
    assert not any("ST" in p for p in pieces)


def test_no_stop_trim_keeps_the_stop_string(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("one two STOP")
    pieces = stream(smollm2_tokenizer, ids, DecodeConfig(stop=["STOP"], no_stop_trim=True),
                    finish={"type": "stop", "matched": "STOP"})
    assert "".join(pieces) == "one two STOP"


def test_matched_stop_token_is_not_in_the_text(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hello there") + [2]
    cfg = DecodeConfig(skip_special_tokens=False)
    pieces = stream(smollm2_tokenizer, ids, cfg, finish={"type": "stop", "matched": 2})
    assert "".join(pieces) == "Hello there"


@pytest.mark.parametrize("text,stops,expected", [
    ("abc S", ["STOP"], 1), ("abc ST", ["STOP"], 2), ("abc", ["STOP"], 0), ("xx\n", ["\n\n"], 1),
    ("done", ["e", "one!"], 3),
])
def test_stop_holdback(text, stops, expected):
    assert stop_holdback(text, stops) == expected
