"""Serving benchmark: stream completions from an OpenAI-compatible server under standard workloads (SGLang's five,
and ``editing``: repeat a passage with a small change, where speculative decoding pays).

``python -m sgl_jax.bench_serving --base-url http://127.0.0.1:30000 --workload all`` sends each workload's
requests on its arrival schedule, streams every response and reports, per workload, output throughput
(tok/s), request throughput (req/s), time to first token (TTFT) and inter-token latency (ITL) P50/P95/P99,
end-to-end latency P50 and the error count; a table on stdout and a JSON report (``--output-file``), or with
``--report NAME.md`` a generated pair, NAME.md (the command, the table and the server's claims, computed from the
JSON alone) and NAME.json (the JSON report); notes go in NAME.notes.md, never in those two.
``--compare A.json B.json`` prints two reports side by side with the ratio A/B of each metric.

The server's raw ``/get_server_info`` is saved in the JSON report (``server_info``: ``start``, before the
warm-up, and ``end``, after the last workload), and the summary's claims about the server -- programs compiled
after warm-up (``num_compiles_after_warmup``), ``memory_errors`` and the prefill step budget's fit
(``prefill_step_budget``: coefficients, last chunk limit) -- are read from that saved output. With ``--backend
sgl-jax`` a server without /get_server_info is an error; with ``--backend openai`` (any server) its absence is
recorded (``server_info_error``).

Backends: ``sgl-jax`` streams from the native ``/generate`` endpoint (SGLang's request shape; its
``meta_info`` gives exact token counts and ``cached_tokens``), ``openai`` from ``/v1/completions`` (any
OpenAI-compatible server, e.g. llama.cpp's; tokens are counted from ``usage`` when the server sends it
with ``stream_options.include_usage``, else one per streamed chunk).

Prompts are real English text (Python's own ``pydoc_data.topics``, public domain, offline) cut to the
target token counts with the served model's tokenizer. Every request asks for exactly ``max_tokens``
tokens (``ignore_eos`` and ``min_tokens`` are both sent, since some servers honour only one), greedy. A
request counts as an error on any HTTP error, or when its stream ends without a finish reason or with
fewer tokens than asked, even with HTTP 200. The workloads follow SGLang's ``bench_serving`` metrics (TTFT
from sending to the first streamed token, ITL between streamed chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import re
import shlex
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from sgl_jax.bench_utils import cpu_name, format_server_claims, write_report

# (weight, low, high) token-count ranges; a request draws a range by weight, then a count uniformly in it.
Lengths = Tuple[Tuple[float, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One standard workload.

    num_requests: requests before --num-requests-scale. prompt / output: token-count distributions.
    arrival: "sequential" (each request after the previous one finishes), "uniform" (every 1/rate s),
    "burst" (all at t = 0) or "poisson" (exponential gaps, mean 1/rate s). rate: requests/s before
    --request-rate-scale. shared_prefix: tokens of one common prefix in front of every prompt (the prompt
    distribution then gives the suffix). edit: the prompt asks to repeat a passage (of the prompt distribution's
    length) with one small change, and the output is as long as the passage (`editing_prompt`).
    """

    name: str
    num_requests: int
    prompt: Lengths
    output: Lengths
    arrival: str
    rate: float = 0.0
    shared_prefix: int = 0
    edit: bool = False


WORKLOADS: Dict[str, Workload] = {w.name: w for w in (
    Workload("baseline", 10, ((1, 256, 256),), ((1, 256, 256),), "sequential"),
    Workload("continuous_batching", 32, ((1, 64, 512),), ((1, 64, 256),), "uniform", rate=4),
    Workload("paged_attention", 48, ((1, 128, 384),), ((1, 128, 256),), "burst"),
    Workload("chunked_prefill", 48, ((0.75, 1024, 2048), (0.25, 64, 128)), ((1, 64, 256),), "poisson", rate=6),
    Workload("prefix_caching", 48, ((1, 32, 128),), ((1, 256, 256),), "uniform", rate=8, shared_prefix=1024),
    # copy-heavy, as code-editing assistants are: where n-gram speculative decoding pays (--speculative-algorithm)
    Workload("editing", 5, ((1, 300, 800),), ((1, 0, 0),), "sequential", edit=True),
)}
NUM_WARMUP = 2
WARMUP_MAX_TOKENS = 16


@dataclasses.dataclass
class RequestSpec:
    """A request to send: prompt text, its token count under the client's tokenizer, tokens to generate,
    and its arrival time in seconds from the start of the run (None: after the previous one finishes)."""

    prompt: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: Optional[float]


@dataclasses.dataclass
class RequestResult:
    """What one streamed request measured. Times in seconds; itl_s: gaps between streamed chunks."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0  # as the server reports it (else the client's count)
    output_tokens: int = 0
    cached_tokens: Optional[int] = None  # server-side prefix-cache hit, when the server reports it
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: List[float] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------------------------- prompts
def corpus_token_ids(tokenizer) -> List[int]:
    """Token ids of Python's pydoc topics text (about 0.5 M tokens of English prose and code)."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return tokenizer.encode(text, add_special_tokens=False)


def _draw(rng: random.Random, lengths: Lengths) -> int:
    weights = [w for w, _, _ in lengths]
    _, lo, hi = rng.choices(lengths, weights=weights)[0]
    return rng.randint(lo, hi)


def _scaled(n: int, scale: float) -> int:
    return max(1, int(round(n * scale)))


def editing_prompt(rng: random.Random, passage: str) -> str:
    """The editing workload's prompt: repeat `passage` with one word (of 4+ letters, drawn from it) written in
    capitals, as a code-editing assistant is asked to rewrite a file with a small change."""
    words = re.findall(r"[A-Za-z]{4,}", passage) or ["text"]
    old = rng.choice(words)
    return (f"Repeat the following passage exactly, but write the word '{old}' as '{old.upper()}'.\n\n{passage}\n\n"
            f"The passage with that change:\n\n")


def make_requests(workload: Workload, tokenizer, corpus: Sequence[int], *, seed: int, num_requests_scale=1.0,
                  request_rate_scale=1.0, prompt_len_scale=1.0, output_len_scale=1.0,
                  count: Optional[int] = None) -> List[RequestSpec]:
    """The workload's requests, deterministic for a seed.

    Prompt and output lengths are drawn, then multiplied by the length scales (CI); the number of requests
    by num_requests_scale (or exactly `count`), the arrival rate by request_rate_scale.
    Raises ValueError for an unknown arrival pattern or a prompt longer than the corpus.
    """
    rng = random.Random(f"{seed}-{workload.name}")
    n = count if count is not None else _scaled(workload.num_requests, num_requests_scale)
    prefix: List[int] = []
    if workload.shared_prefix:
        k = _scaled(workload.shared_prefix, prompt_len_scale)
        start = rng.randrange(0, len(corpus) - k)
        prefix = list(corpus[start:start + k])
    rate = workload.rate * request_rate_scale
    t, specs = 0.0, []
    for i in range(n):
        drawn = _draw(rng, workload.prompt)
        plen = _scaled(drawn, prompt_len_scale)
        # an editing request's output repeats its passage (the output scale applies to the passage's length)
        olen = _scaled(drawn if workload.edit else _draw(rng, workload.output), output_len_scale)
        if plen >= len(corpus):
            raise ValueError(f"prompt of {plen} tokens is longer than the corpus")
        start = rng.randrange(0, len(corpus) - plen)
        ids = prefix + list(corpus[start:start + plen])
        if workload.edit:
            ids = tokenizer.encode(editing_prompt(rng, tokenizer.decode(ids)), add_special_tokens=False)
        if workload.arrival == "sequential":
            arrival = None
        elif workload.arrival == "burst":
            arrival = 0.0
        elif workload.arrival == "uniform":
            arrival = i / rate
        elif workload.arrival == "poisson":
            arrival = t
            t += rng.expovariate(rate)
        else:
            raise ValueError(f"unknown arrival pattern {workload.arrival!r}")
        specs.append(RequestSpec(tokenizer.decode(ids), len(ids), olen, arrival))
    return specs


# ---------------------------------------------------------------------------------------------- client
def _payload(backend: str, model: str, spec: RequestSpec, max_tokens: int) -> Tuple[str, dict]:
    if backend == "sgl-jax":
        return "/generate", {"text": spec.prompt, "stream": True, "sampling_params": {
            "max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0}}
    return "/v1/completions", {
        "model": model, "prompt": spec.prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
        "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def send_request(client, base_url: str, backend: str, model: str, spec: RequestSpec,
                       max_tokens: Optional[int] = None) -> RequestResult:
    """Stream one request; never raises (failures are returned as an error result)."""
    max_tokens = spec.max_tokens if max_tokens is None else max_tokens
    path, body = _payload(backend, model, spec, max_tokens)
    res = RequestResult(prompt_tokens=spec.prompt_tokens)
    start = last = time.perf_counter()
    finish, chunks, reported = None, 0, None
    try:
        async with client.stream("POST", base_url + path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {str(obj['error'])[:200]}"
                    return res
                now = time.perf_counter()
                if backend == "sgl-jax":
                    meta = obj.get("meta_info", {})
                    new = meta.get("completion_tokens", 0) - (reported or 0)
                    reported = meta.get("completion_tokens", 0)
                    res.prompt_tokens = meta.get("prompt_tokens", res.prompt_tokens)
                    res.cached_tokens = meta.get("cached_tokens", res.cached_tokens)
                    finish = meta.get("finish_reason") or finish
                else:
                    usage = obj.get("usage")
                    if usage:
                        reported = usage.get("completion_tokens", reported)
                        res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            res.cached_tokens = details["cached_tokens"]
                    choices = obj.get("choices") or []
                    # one token per chunk unless usage says otherwise; a chunk that only carries the
                    # finish_reason (empty text, as llama-cpp-python ends its streams) is no token
                    new = int(any(c.get("text") or not c.get("finish_reason") for c in choices))
                    for c in choices:
                        finish = c.get("finish_reason") or finish
                if new > 0:
                    chunks += new
                    if res.ttft_s == 0.0:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 -- any transport failure is this request's error
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.e2e_s = time.perf_counter() - start
    res.output_tokens = reported if reported is not None else chunks
    if finish is None:
        res.error = "stream ended without a finish_reason"
    elif res.output_tokens < max_tokens:
        res.error = f"{res.output_tokens} tokens, asked for {max_tokens}"
    else:
        res.ok = True
    return res


async def run_workload(client, base_url: str, backend: str, model: str, specs: List[RequestSpec],
                       desc: str, warmup: Sequence[RequestSpec] = ()) -> Tuple[List[RequestResult], float]:
    """Warm-up requests one by one (not measured), then `specs` on their arrival schedule.

    Returns (results in request order, duration in s from the first send to the last completion).
    """
    from tqdm.auto import tqdm

    for spec in warmup:
        await send_request(client, base_url, backend, model, spec, min(spec.max_tokens, WARMUP_MAX_TOKENS))
    results: List[Optional[RequestResult]] = [None] * len(specs)
    bar = tqdm(total=len(specs), desc=desc, unit="req", file=sys.stderr)
    t0 = time.perf_counter()

    async def one(i: int, spec: RequestSpec):
        if spec.arrival_s:
            await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.perf_counter()))
        results[i] = await send_request(client, base_url, backend, model, spec)
        bar.update()

    try:
        if specs and specs[0].arrival_s is None:
            for i, spec in enumerate(specs):
                await one(i, spec)
        else:
            await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
    finally:
        bar.close()
    return results, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- metrics
def _pct(values: Sequence[float], q: float) -> Optional[float]:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict:
    """Per-workload metrics: throughputs per second of the run, latencies in ms, token totals."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1e3 for r in ok]
    itl = [x * 1e3 for r in ok for x in r.itl_s]
    e2e = [r.e2e_s * 1e3 for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "cached_tokens": sum(cached) if cached else None,
        "output_throughput_tok_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "request_throughput_req_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p95": _pct(ttft, 95), "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(itl, 50), "itl_ms_p95": _pct(itl, 95), "itl_ms_p99": _pct(itl, 99),
        "e2e_ms_p50": _pct(e2e, 50),
        "requests": [dataclasses.asdict(r) | {"itl_s": None, "num_chunks": len(r.itl_s) + (1 if r.ok else 0)}
                     for r in results],
    }


COLUMNS = [  # (key, header, format)
    ("completed", "done", "{:.0f}"), ("errors", "err", "{:.0f}"),
    ("output_throughput_tok_s", "out tok/s", "{:.1f}"), ("request_throughput_req_s", "req/s", "{:.3f}"),
    ("ttft_ms_p50", "TTFT p50 ms", "{:.0f}"), ("ttft_ms_p95", "TTFT p95", "{:.0f}"),
    ("ttft_ms_p99", "TTFT p99", "{:.0f}"), ("itl_ms_p50", "ITL p50 ms", "{:.1f}"),
    ("itl_ms_p95", "ITL p95", "{:.1f}"), ("itl_ms_p99", "ITL p99", "{:.1f}"), ("e2e_ms_p50", "E2E p50 ms", "{:.0f}"),
]


def _fmt(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(v)


def format_table(report: dict) -> str:
    """A markdown table: one row per workload."""
    head = ["workload"] + [h for _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in report["workloads"].items():
        lines.append("| " + " | ".join([name] + [_fmt(f, m.get(k)) for k, _, f in COLUMNS]) + " |")
    return "\n".join(lines)


def format_comparison(a: dict, b: dict, label_a: str = "A", label_b: str = "B") -> str:
    """Two reports side by side: for every workload in both, each metric of A, of B, and A/B."""
    lines = [f"A = {label_a} ({a.get('backend')}, {a.get('base_url')}); B = {label_b} ({b.get('backend')}, "
             f"{b.get('base_url')})", "", "| workload | metric | A | B | A/B |", "|---|---|---|---|---|"]
    for name, ma in a["workloads"].items():
        mb = b["workloads"].get(name)
        if mb is None:
            continue
        for key, header, fmt in COLUMNS:
            va, vb = ma.get(key), mb.get(key)
            ratio = f"{va / vb:.2f}" if va is not None and vb not in (None, 0) else "-"
            lines.append(f"| {name} | {header} | {_fmt(fmt, va)} | {_fmt(fmt, vb)} | {ratio} |")
    return "\n".join(lines)


def format_server_summary(report: dict) -> str:
    """The server's claims, from the raw /get_server_info saved in `report` (``server_info``): programs compiled
    after warm-up at the end and during the run (end - start), memory errors, and the prefill step budget's
    fit, per DP rank; or why there is none."""
    info = report.get("server_info")
    if info is None:
        return f"server: no /get_server_info ({report.get('server_info_error', 'not fetched')})"
    start, end = info["start"]["internal_states"], info["end"]["internal_states"]
    during = [None if e.get("num_compiles_after_warmup") is None else
              e["num_compiles_after_warmup"] - (s.get("num_compiles_after_warmup") or 0) for s, e in zip(start, end)]
    lines = [f"server at the end of the run (raw /get_server_info in the JSON report; programs compiled "
             f"after warm-up during the run, per rank: {during}):", format_server_claims(info["end"])]
    spec = speculation_summary(start, end)
    if spec:
        lines.append(spec)
    return "\n".join(lines)


def speculation_summary(start: List[dict], end: List[dict]) -> str:
    """Speculative decoding during the run (end - start of every rank's counters, the warm-up requests included):
    verify steps, the requests' drafts verified in them, draft tokens verified and accepted, the mean accepted
    length (tokens a request's verified draft gives: its accepted drafts + the bonus token) and the acceptance rate;
    "" when the server does not speculate."""
    keys = ("spec_verify_steps", "spec_drafted_rows", "spec_draft_tokens", "spec_accepted_tokens")
    if not end or any(k not in end[0] for k in keys):
        return ""
    steps, rows, drafted, accepted = (sum(e[k] - s.get(k, 0) for s, e in zip(start, end)) for k in keys)
    unpaid = sum(e.get("spec_unpaid_steps", 0) - s.get("spec_unpaid_steps", 0) for s, e in zip(start, end))
    rule = f"; {unpaid} decode batches did not draft because drafting would not pay" if unpaid else ""
    if rows == 0:
        return f"speculative decoding: no draft verified during the run{rule}"
    return (f"speculative decoding during the run: {steps} verify steps, {rows} drafts verified ({drafted} draft "
            f"tokens), {accepted} accepted; mean accepted length {(accepted + rows) / rows:.2f} tokens per verified "
            f"draft, acceptance rate {accepted / max(drafted, 1):.2f}{rule}")


# ---------------------------------------------------------------------------------------------- main
def load_tokenizer_for(path: Optional[str]):
    """The served model's tokenizer: an HF directory, a .gguf file (its metadata), an installed model package or a
    hub id org/name (its tokenizer files, through huggingface_hub's cache: `model_config.resolve_tokenizer_path`),
    default SmolLM2-135M-Instruct's GGUF."""
    from transformers import AutoTokenizer

    from sgl_jax.srt.configs.model_config import resolve_tokenizer_path

    return AutoTokenizer.from_pretrained(resolve_tokenizer_path(path))


async def _served_model(client, base_url: str) -> str:
    try:
        r = await client.get(base_url + "/v1/models")
        return r.json()["data"][0]["id"]
    except Exception:  # noqa: BLE001 -- servers that do not list models accept any name
        return "default"


async def _server_info(client, base_url: str, backend: str) -> dict:
    """The server's raw GET /get_server_info. An sgl-jax server must answer it; an openai-backend server need not
    be sgl-jax, so its failure is a LookupError the caller records.

    Raises:
        LookupError: no usable /get_server_info from an openai-backend server (its message says why).
        httpx.HTTPError: from an sgl-jax server.
    """
    import httpx

    try:
        r = await client.get(base_url + "/get_server_info")
        r.raise_for_status()
        info = r.json()
        if not isinstance(info, dict) or "internal_states" not in info:
            raise ValueError("no internal_states in the answer")
        return info
    except (httpx.HTTPError, ValueError) as e:
        if backend == "sgl-jax":
            raise
        raise LookupError(f"{type(e).__name__}: {e}"[:300]) from e


async def run_benchmark(args, command: str = "") -> dict:
    """Run the selected workloads against args.base_url; returns the report dict (with the server's raw
    /get_server_info before and after them, ``server_info``)."""
    import httpx

    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    for n in names:
        if n not in WORKLOADS:
            raise SystemExit(f"unknown workload {n!r}; choose from {', '.join(WORKLOADS)} or all")
    tokenizer = load_tokenizer_for(args.tokenizer)
    corpus = corpus_token_ids(tokenizer)
    base_url = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    report = {
        "backend": args.backend, "base_url": base_url, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "seed": args.seed, "num_requests_scale": args.num_requests_scale,
        "request_rate_scale": args.request_rate_scale, "prompt_len_scale": args.prompt_len_scale,
        "output_len_scale": args.output_len_scale, "machine": cpu_name(),
        "command": command,
        "workloads": {},
    }
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        model = args.model or await _served_model(client, base_url)
        report["model"] = model
        try:
            start = await _server_info(client, base_url, args.backend)
        except LookupError as e:
            start, report["server_info_error"] = None, str(e)
        for name in names:
            w = WORKLOADS[name]
            kw = dict(seed=args.seed, num_requests_scale=args.num_requests_scale,
                      request_rate_scale=args.request_rate_scale, prompt_len_scale=args.prompt_len_scale,
                      output_len_scale=args.output_len_scale)
            specs = make_requests(w, tokenizer, corpus, **kw)
            warmup = make_requests(w, tokenizer, corpus, **dict(kw, seed=f"{args.seed}-warmup"), count=NUM_WARMUP)
            results, duration = await run_workload(client, base_url, args.backend, model, specs, name, warmup)
            m = summarize(results, duration)
            m["requested_output_tokens"] = [s.max_tokens for s in specs]
            report["workloads"][name] = m
            print(f"{name}: {m['completed']}/{m['num_requests']} ok, {m['output_throughput_tok_s']:.1f} out tok/s, "
                  f"TTFT p50 {_fmt('{:.0f}', m['ttft_ms_p50'])} ms, ITL p50 {_fmt('{:.1f}', m['itl_ms_p50'])} ms",
                  flush=True)
        if start is not None:
            report["server_info"] = {"start": start, "end": await _server_info(client, base_url, args.backend)}
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sgl_jax.bench_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server address")
    p.add_argument("--backend", choices=["sgl-jax", "openai"], default="sgl-jax",
                   help="sgl-jax: native /generate; openai: /v1/completions (any OpenAI-compatible server)")
    p.add_argument("--workload", default="all", help=f"one of {', '.join(WORKLOADS)}, a comma list, or all")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--model", default=None, help="model name sent to openai servers (default: from /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer of the served model: HF dir/name or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests-scale", type=float, default=1.0, help="multiply every workload's request count")
    p.add_argument("--request-rate-scale", type=float, default=1.0, help="multiply every workload's arrival rate")
    p.add_argument("--prompt-len-scale", type=float, default=1.0, help="multiply prompt lengths (CI)")
    p.add_argument("--output-len-scale", type=float, default=1.0, help="multiply output lengths (CI)")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--output-file", default=None,
                   help="JSON report (default: benchmark/reports/bench_serving-<backend>-<time>.json)")
    p.add_argument("--report", default=None, metavar="NAME.md",
                   help="write the generated pair NAME.md (table and server claims) and NAME.json (the JSON report) "
                        "instead of --output-file")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="print two reports side by side with ratios A/B and exit")
    return p


def report_body(report: dict) -> str:
    """The generated markdown of a JSON report, computed from it alone: the setup, the table, the server."""
    scales = ", ".join(f"{k} {report[k]:g}" for k in ("num_requests_scale", "request_rate_scale", "prompt_len_scale",
                                                       "output_len_scale"))
    return "\n\n".join([f"Backend {report['backend']} at {report['base_url']}, model {report['model']}, seed "
                         f"{report['seed']}, {scales}; machine {report['machine']}; {report['date']}.",
                         format_table(report), format_server_summary(report)])


def main(argv: Optional[List[str]] = None) -> dict:
    """Run the benchmark (or --compare); write and print the report. Returns the report dict ({} for --compare)."""
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser()
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        print(format_comparison(a, b, *args.compare))
        return {}
    if args.report and args.output_file:
        p.error("--report writes NAME.json beside NAME.md: give --report or --output-file, not both")
    command = "python -m sgl_jax.bench_serving " + shlex.join(argv)
    report = asyncio.run(run_benchmark(args, command))
    print(format_table(report))
    print(format_server_summary(report))
    if args.report:
        title = f"bench_serving: {', '.join(report['workloads'])} ({report['date'][:10]})"
        print(f"report: {args.report} (+ .json)")
        write_report(args.report, title, command, report_body(report), report)
        return report
    out = args.output_file or os.path.join(
        "benchmark", "reports", f"bench_serving-{args.backend}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"report: {out}")
    return report


if __name__ == "__main__":
    main()
