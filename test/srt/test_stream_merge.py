"""routes/common.merge_stream_batches and merge_streams: the SSE routes' merging of a request's streams (issue #69:
events that arrive together go out as one write; one stream runs in the caller's task and is closed with it)."""

import asyncio

import pytest

from sgl_jax.srt.entrypoints.routes.common import merge_stream_batches, merge_streams


async def _source(name: str, n: int, closed: list):
    try:
        for k in range(n):
            yield f"{name}{k}"
    finally:
        closed.append(name)


async def _collect(agen) -> list:
    return [x async for x in agen]


def test_items_that_arrived_together_come_as_one_batch():
    closed = []
    batches = asyncio.run(_collect(merge_stream_batches([_source(s, 3, closed) for s in "abc"])))
    # (the sources never wait, so every item is queued before the consumer first wakes: one batch of all nine)
    assert len(batches) == 1, batches
    pairs = batches[0]
    assert sorted(pairs) == sorted((i, f"{s}{k}") for i, s in enumerate("abc") for k in range(3))
    for i, s in enumerate("abc"):  # each source's items in its own order
        assert [x for j, x in pairs if j == i] == [f"{s}0", f"{s}1", f"{s}2"]
    assert sorted(closed) == ["a", "b", "c"]


def test_merge_streams_yields_pairs_in_arrival_order():
    closed = []
    pairs = asyncio.run(_collect(merge_streams([_source(s, 2, closed) for s in "ab"])))
    assert sorted(pairs) == [(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1")]
    assert [x for j, x in pairs if j == 1] == ["b0", "b1"]


def test_one_stream_is_closed_with_the_merged_iterator():
    closed = []

    async def run():
        merged = merge_streams([_source("a", 5, closed)])
        assert await merged.__anext__() == (0, "a0")
        await merged.aclose()  # (the client went away: the source's cleanup, aborting its request, runs now)
        return list(closed)

    assert asyncio.run(run()) == ["a"]


def test_a_source_error_comes_after_the_items_before_it():
    async def failing():
        yield "x0"
        raise RuntimeError("engine failed the request")

    async def run():
        got = []
        with pytest.raises(RuntimeError, match="engine failed"):
            async for batch in merge_stream_batches([failing(), _source("b", 1, [])]):
                got += batch
        return got

    got = asyncio.run(run())
    assert (0, "x0") in got
