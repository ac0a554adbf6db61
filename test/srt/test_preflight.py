"""The memory preflight (preflight.py) alone: its page count against a direct count of the pages the
sequences hold, and its limits, messages and statuses. No model, no server."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.io_struct import SchedulerInfo
from sgl_jax.srt.preflight import KVLimits, check_fits, kv_tokens_needed


def pages_held(prompt: int, out: int, seqs: int, page: int) -> int:
    """Count directly: the first sequence holds the pages of its prompt + output; every other one reuses the
    prompt's full pages (a radix cache matches whole pages) and holds its own for the rest."""
    owned = set()
    for s in range(seqs):
        for pos in range(prompt + out):
            shared = pos < (prompt // page) * page
            owned.add(("shared", pos // page) if shared else (s, pos // page))
    return len(owned)


@given(st.integers(1, 300), st.integers(0, 20), st.integers(1, 6), st.sampled_from([1, 2, 4, 16, 64]))
def test_kv_tokens_needed_counts_whole_pages_with_the_prompt_shared(prompt, out, seqs, page):
    assert kv_tokens_needed(prompt, out, seqs, page) == pages_held(prompt, out, seqs, page) * page


def test_check_fits_limits_and_messages():
    limits = KVLimits(context_len=1024, max_req_input_len=1023, kv_pool_tokens=256, page_size=16)
    check_fits(limits, 255)  # 256 tokens -> 16 pages = 256: fits exactly
    with pytest.raises(RequestError) as e:
        check_fits(limits, 256)  # 257 tokens -> 17 pages
    assert e.value.status_code == 413 and "needs 272 KV tokens" in e.value.message and "holds 256" in e.value.message
    with pytest.raises(RequestError) as e:
        check_fits(limits, 200, min_output=57)
    assert e.value.status_code == 413 and "at least 57 output token(s)" in e.value.message
    # a fan-out shares the prompt's 10 full pages: 4 sequences of a 160-token prompt take 11 + 3 pages ...
    check_fits(limits, 160, min_output=1, num_seqs=4)
    # ... 12 take 11 + 11 = 22 > 16 pages, and the message says so
    with pytest.raises(RequestError) as e:
        check_fits(limits, 160, min_output=1, num_seqs=12)
    assert "for each of 12 sequences sharing the prompt" in e.value.message
    small = KVLimits(context_len=1024, max_req_input_len=256, kv_pool_tokens=4096, page_size=1)
    with pytest.raises(RequestError) as e:
        check_fits(small, 300, what="The input", at_least=True)
    assert e.value.status_code == 413 and "at least 300 tokens" in e.value.message and "largest prefill" in e.value.message
    info = SchedulerInfo(max_total_tokens=64, max_running_requests=2, max_prefill_tokens=64, max_req_input_len=7,
                         context_len=8, page_size=4, kv_cache_dtype="float32", chunked_prefill_size=-1,
                         prefix_cache="radix", vocab_size=100, architecture="LlamaForCausalLM", token_paddings=[64],
                         bs_paddings=[1, 2], dp_size=1, tp_size=1, load_balance_method="round_robin",
                         enable_mixed_chunk=False, max_prefill_step_ms=0.0)
    assert KVLimits.from_info(info) == KVLimits(8, 7, 64, 4)
