"""Structured-output benchmark: JSON-schema decoding of concurrent requests against the same load unconstrained.

``python -m sgl_jax.bench_structured_output --base-url http://127.0.0.1:30000 [--num-requests 16]
[--output-file result.json | --report NAME.md]``

Sends `num_requests` concurrent /generate requests, each with a JSON schema (four schemas in turn, sampled
with per-request seeds), validates every output against its schema (`jsonschema`), then sends the same
prompts unconstrained with ``max_new_tokens = min_new_tokens =`` each constrained request's output length,
so both runs generate exactly the same number of tokens per request. Reports output tok/s of both and the
ratio (issue #12's target: constrained >= 80% of unconstrained), with the machine's rates beside them: measured
in the same run, before the requests, on the machine that runs the benchmark
(`bench_utils.machine_rates_in_subprocess`), never a constant. The result keeps the server's raw /get_server_info
after both passes (``server_info``), from which its claims (compiles after warm-up, memory errors) are printed.
``--report NAME.md`` writes the generated pair NAME.md / NAME.json (`bench_utils.write_report`); notes go in
NAME.notes.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import time
from typing import List, Optional

import httpx

from sgl_jax.bench_utils import (MachineRates, cpu_name, fetch_server_info, format_server_claims,
                                 machine_rates_in_subprocess, publish_result)

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                      "email": {"type": "string", "maxLength": 32}},
     "required": ["name", "age", "email"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "country": {"type": "string", "maxLength": 24},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "country", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                      "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
                                      "genres": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                 "maxItems": 3}},
     "required": ["title", "year", "genres"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                                      "reason": {"type": "string", "maxLength": 60}},
     "required": ["answer", "confidence", "reason"], "additionalProperties": False},
]
QUESTIONS = ["Describe a person with a name, age and email.", "Describe a large city.",
             "Describe a famous film.", "Is it going to rain tomorrow? Explain briefly."]
CHAT = "<|im_start|>user\n{} Answer in JSON.<|im_end|>\n<|im_start|>assistant\n"


def _post(client: httpx.Client, url: str, body: dict) -> dict:
    r = client.post(url + "/generate", json=body, timeout=1800)
    r.raise_for_status()
    return r.json()


def _run(url: str, bodies: List[dict]) -> tuple:
    """(responses, wall seconds) for `bodies` sent at once."""
    with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        t0 = time.perf_counter()
        outs = list(pool.map(lambda b: _post(client, url, b), bodies))
        return outs, time.perf_counter() - t0


def run_benchmark(base_url: str, num_requests: int = 16, max_new_tokens: int = 160, seed: int = 42) -> dict:
    """Run both passes; returns the result dict (rows, ratio, validity, the machine ``rates`` measured before
    them, the server's raw /get_server_info after them: ``server_info``).

    Raises:
        AssertionError: an output that does not parse or validate (the count is also in the result).
    """
    import jsonschema

    rates = machine_rates_in_subprocess()  # before any request: the machine is idle
    constrained = [{"text": CHAT.format(QUESTIONS[i % 4]),
                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.7, "seed": seed + i,
                                        "json_schema": json.dumps(SCHEMAS[i % 4])}} for i in range(num_requests)]
    _run(base_url, constrained[:2])  # warm-up: grammar cache, tokenizer
    outs, t_con = _run(base_url, constrained)
    invalid = 0
    for i, o in enumerate(outs):
        try:
            jsonschema.validate(json.loads(o["text"]), SCHEMAS[i % 4])
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
    lengths = [o["meta_info"]["completion_tokens"] for o in outs]
    plain = [{"text": b["text"], "sampling_params": {"max_new_tokens": n, "min_new_tokens": n, "temperature": 0.7,
                                                     "seed": seed + i, "ignore_eos": True}}
             for i, (b, n) in enumerate(zip(constrained, lengths))]
    plain_outs, t_plain = _run(base_url, plain)
    plain_tokens = sum(o["meta_info"]["completion_tokens"] for o in plain_outs)
    tokens = sum(lengths)
    rows = [
        {"run": "json_schema", "requests": num_requests, "output_tokens": tokens, "seconds": t_con,
         "tok_per_s": tokens / t_con, "valid": num_requests - invalid},
        {"run": "unconstrained", "requests": num_requests, "output_tokens": plain_tokens, "seconds": t_plain,
         "tok_per_s": plain_tokens / t_plain, "valid": None},
    ]
    result = {"rows": rows, "ratio": rows[0]["tok_per_s"] / rows[1]["tok_per_s"], "invalid": invalid,
              "num_requests": num_requests, "max_new_tokens": max_new_tokens, "cpu": cpu_name(),
              "rates": rates.to_json(), "server_info": fetch_server_info(base_url)}
    assert invalid == 0, f"{invalid} of {num_requests} outputs did not validate against their schema"
    return result


def format_table(result: dict) -> str:
    """A markdown table of `run_benchmark`'s result, computed from it alone: the machine rates measured in the
    run in every row, the server's claims from its raw /get_server_info below."""
    rates = MachineRates.from_json(result["rates"])
    lines = ["| run | requests | output tokens | s | output tok/s | valid outputs | machine rates (mem GB/s, "
             "matmul GFLOP/s) |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        valid = "-" if r["valid"] is None else f"{r['valid']}/{r['requests']}"
        lines.append(f"| {r['run']} | {r['requests']} | {r['output_tokens']} | {r['seconds']:.1f} | "
                     f"{r['tok_per_s']:.1f} | {valid} | {rates.memory_gbps:.1f}, {rates.matmul_gflops:.1f} |")
    lines += [f"\nconstrained / unconstrained output tok/s: **{result['ratio']:.3f}** (target >= 0.80)", "",
              f"Machine rates {rates.describe()}.", "",
              "Server after both passes (raw /get_server_info in the .json):", "",
              format_server_claims(result["server_info"])]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output-file", default=None, help="write the result as JSON here")
    p.add_argument("--report", default=None, metavar="NAME.md", help="write the generated pair NAME.md (the table) "
                   "and NAME.json (the result)")
    args = p.parse_args(argv)
    result = run_benchmark(args.base_url, args.num_requests, args.max_new_tokens, args.seed)
    result["date"] = datetime.date.today().isoformat()
    publish_result("sgl_jax.bench_structured_output", argv, result, f"Structured-output benchmark ({result['date']})",
                   format_table, args.output_file, args.report)


if __name__ == "__main__":
    main()
