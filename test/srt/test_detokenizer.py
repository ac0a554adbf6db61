"""Incremental detokenization with the real SmolLM2 tokenizer: UTF-8 safety, stop strings, and the direct Rust
decode it uses (the text tokenizer.decode gives)."""

import pytest

import copy
import random

from sgl_jax.srt.tokenizer.detokenizer_manager import IncrementalDetokenizer, stop_holdback, text_decoder
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


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_direct_decode_gives_what_tokenizer_decode_gives(smollm2_tokenizer, skip_special_tokens):
    """text_decoder calls the Rust tokenizer's decode directly (2x less detokenizer time a step): on runs of random
    ids, special tokens, byte pieces of multibyte characters and the text above, with and without
    skip_special_tokens, its text equals tokenizer.decode's; a tokenizer that cleans up spaces keeps the wrapper."""
    tok = smollm2_tokenizer
    rng = random.Random(0)
    runs = [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    special = sorted(set(tok.all_special_ids))
    runs += [special, special + tok.encode(TEXT)[:7], tok.encode(TEXT), tok.encode(TEXT)[3:4], []]
    config = DecodeConfig(skip_special_tokens=skip_special_tokens)
    decode = text_decoder(tok, config)
    assert decode.__closure__ is not None and not any(c.cell_contents is tok for c in decode.__closure__)  # direct
    for ids in runs:
        assert decode(ids) == tok.decode(ids, skip_special_tokens=skip_special_tokens), ids
    cleaning = copy.copy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert any(c.cell_contents is cleaning for c in text_decoder(cleaning, config).__closure__)  # the wrapper
