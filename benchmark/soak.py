"""Soak test: a mixed workload against an sgl-jax server for a fixed time; per interval a row of counts, KV pool
state and RSS; leak checks on the drained server; a markdown report and a .json beside it.

    python benchmark/soak.py --duration-min 30 --concurrency 8 --report reports/soak-cpu-<date>.md \
        --interval-s 60 --warmup-min 5 --seed 0 [--url http://127.0.0.1:PORT [--server-pid PID] | -- SERVER ARGS]

Without --url it starts ``python -m sgl_jax.launch_server --host 127.0.0.1 --port <free> --enable-metrics SERVER
ARGS`` (default ``--max-running-requests 16 --max-total-tokens 8192``), waits for /health and stops it with SIGTERM
at the end (exit code 0 expected). With --url, RSS is that of --server-pid or of the process listening on the port.

--concurrency seeded workers (loopback, every request with a timeout) run one operation at a time (WEIGHTS):
gen / gen_stream (/generate, 8-48 new tokens, temperature 0 or 0.7, prompts of ~5-400 tokens, half behind one of
four shared prefixes), chat / chat_stream (/v1/chat/completions), score (/v1/score: 4-32 items, 2 labels),
disc_stream (a stream closed after 1-5 chunks), disc_cancel (a /generate cancelled after 0.05-2 s), abort
(/generate with a "rid", then POST /abort_request while it runs), flush (POST /flush_cache).

Columns (one row per --interval-s; counts within the interval; "end": after the drain, checks and flush):
  ok        operations that succeeded, by kind (a disconnect whose request finished first counts as ok)
  expected  expected outcomes that are not successes: disconnected, aborted, abort_404 (it had finished),
            abort_late (it finished despite the abort), flush_refused (400 while requests ran)
  errors    anything else, "<kind>:<HTTP status | exception class | finish reason>" (first request of each kept)
  KV        /get_server_info internal_states[0] kv_tokens_ total / free / cached / in_use / protected
  reqs      num_running_reqs / num_waiting_reqs, req_slots_free / max_running_requests; mem_err: memory_errors
  RSS MiB   VmRSS (/proc/<pid>/status) summed over the server process and its descendants (per pid in the JSON)

At the end: stop sending, wait for an idle pool (nothing running or waiting, kv_tokens_in_use == protected == 0),
check free + cached == total, req_slots_free == max_running_requests, memory_errors == 0, POST /flush_cache, check
free == total. RSS growth = (max RSS after the warm-up - last RSS within it) / the latter; flat when <= 5%. Exit
status 1 on a failed leak check, any error, or a self-started server not exiting with 0.

The report's .json keeps the server's raw /get_server_info after the final flush (``server_info_end``; the
report's compile and memory-error line is read from it) and the machine rates measured at the start, before the
server (``rates``: `bench_utils.machine_rates_in_subprocess`, printed beside, never a constant). Both files are
generated; notes go in the .notes.md beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from typing import Dict, List, Optional

import httpx

from sgl_jax.bench_utils import (MachineRates, format_server_claims, git_commit, machine_rates_in_subprocess,
                                 notes_path)
DEFAULT_SERVER_ARGS = ["--max-running-requests", "16", "--max-total-tokens", "8192"]
WEIGHTS = {"gen": 24, "gen_stream": 14, "chat": 10, "chat_stream": 8, "score": 10, "disc_stream": 8,
           "disc_cancel": 8, "abort": 10, "flush": 8}
POOL_KEYS = ("kv_tokens_total", "kv_tokens_free", "kv_tokens_cached", "kv_tokens_in_use", "kv_tokens_protected",
             "num_running_reqs", "num_waiting_reqs", "req_slots_free", "max_running_requests", "memory_errors")
TIMEOUT = httpx.Timeout(300.0, connect=10.0)
WORDS = """time person year way day thing world life hand part child eye woman place work week case point number
group problem fact make know take see come think look want give use find tell ask seem feel try leave call good new
first last long great little own other old right big high different small large next early young important few
public bad same able river mountain city garden music story window history science ocean market winter summer light
paper table letter morning evening question answer water house road family friend school""".split()
HEADER = ("| min | ok | expected | errors | KV total/free/cached/in_use/protected | reqs run/wait, slots free/max "
          "| mem_err | RSS MiB |\n|---|---|---|---|---|---|---|---|")


@dataclasses.dataclass
class Tally:
    ok: Counter = dataclasses.field(default_factory=Counter)
    expected: Counter = dataclasses.field(default_factory=Counter)
    errors: Counter = dataclasses.field(default_factory=Counter)
    samples: Dict[str, str] = dataclasses.field(default_factory=dict)  # first request + answer per error


@dataclasses.dataclass
class Ctx:
    url: str
    prefixes: List[str]
    labels: List[int]
    interval: Tally = dataclasses.field(default_factory=Tally)
    total: Tally = dataclasses.field(default_factory=Tally)
    prompt_tokens: List[int] = dataclasses.field(default_factory=lambda: [10 ** 9, 0])  # /generate min, max
    cached_tokens: int = 0

    def add(self, kind: str, cat: str, label: str, detail: str = "") -> None:
        for t in (self.interval, self.total):
            if cat == "ok":
                t.ok[kind] += 1
            elif cat == "expected":
                t.expected[label] += 1
            else:
                t.errors[f"{kind}:{label}"] += 1
                t.samples.setdefault(f"{kind}:{label}", detail)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prompt(rng: random.Random, ctx: Ctx, max_len: int = 400) -> str:
    """~5-400 tokens (these words are about one token each); half behind a shared prefix."""
    if rng.random() < 0.5:
        p = rng.choice(ctx.prefixes)
        return p + " " + words(rng, rng.randint(4, max(4, min(100, max_len - len(p.split())))))
    return words(rng, int(math.exp(rng.uniform(math.log(5), math.log(max_len)))))


def sampling(rng: random.Random, lo: int = 8, hi: int = 48) -> dict:
    return {"max_new_tokens": rng.randint(lo, hi), "temperature": rng.choice([0.0, 0.7])}


def chat_body(rng: random.Random, ctx: Ctx, stream: bool) -> dict:
    s = sampling(rng)
    body = {"model": "default", "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                             {"role": "user", "content": prompt(rng, ctx, 350)}],
            "max_tokens": s["max_new_tokens"], "temperature": s["temperature"]}
    return {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body


def describe(path: str, body, r: Optional[httpx.Response] = None, note: str = "") -> str:
    ans = f" -> {r.status_code} {r.text[:300]!r}" if r is not None else ""
    return f"POST {path} {json.dumps(body)[:600]}{ans}{note}"


def check(ctx: Ctx, kind: str, path: str, body: dict, r: httpx.Response):
    """(category, label, detail) of a finished non-streaming /generate, chat or score."""
    if r.status_code != 200:
        return "error", f"HTTP {r.status_code}", describe(path, body, r)
    out = r.json()
    if path == "/v1/score":
        return ("ok", kind, "") if len(out["scores"]) == len(body["items"]) else (
            "error", "bad_scores", describe(path, body, r))
    if path == "/generate":
        meta, fr = out["meta_info"], out["meta_info"]["finish_reason"]["type"]
        ctx.prompt_tokens[:] = min(ctx.prompt_tokens[0], meta["prompt_tokens"]), max(ctx.prompt_tokens[1],
                                                                                      meta["prompt_tokens"])
        ctx.cached_tokens += meta.get("cached_tokens", 0)
    else:
        fr = out["choices"][0]["finish_reason"]
    return ("ok", kind, "") if fr in ("stop", "length") else ("error", f"finish_{fr}", describe(path, body, r))


async def op_plain(ctx: Ctx, client: httpx.AsyncClient, rng: random.Random, kind: str):
    if kind == "gen":
        path, body = "/generate", {"text": prompt(rng, ctx), "sampling_params": sampling(rng)}
    elif kind == "disc_cancel":  # cancelled (the connection closed) after a short random time
        path, body = "/generate", {"text": prompt(rng, ctx), "sampling_params": {**sampling(rng, 32, 64),
                                                                                 "ignore_eos": True}}
        try:
            r = await asyncio.wait_for(client.post(ctx.url + path, json=body, timeout=TIMEOUT), rng.uniform(0.05, 2))
        except asyncio.TimeoutError:
            return "expected", "disconnected", ""
        return check(ctx, kind, path, body, r)
    elif kind == "chat":
        path, body = "/v1/chat/completions", chat_body(rng, ctx, stream=False)
    else:
        path, body = "/v1/score", {"query": f"Is this passage about {rng.choice(WORDS)}? Passage: ",
                                   "items": [words(rng, rng.randint(3, 12)) for _ in range(rng.randint(4, 32))],
                                   "label_token_ids": ctx.labels, "apply_softmax": True}
    return check(ctx, kind, path, body, await client.post(ctx.url + path, json=body, timeout=TIMEOUT))


async def op_stream(ctx: Ctx, client: httpx.AsyncClient, rng: random.Random, kind: str, stop_after: int = 0):
    """A streaming /generate or chat; with stop_after > 0, close the connection after that many chunks."""
    if kind == "chat_stream" or (stop_after and rng.random() < 0.5):
        path, body = "/v1/chat/completions", chat_body(rng, ctx, stream=True)
        if stop_after:
            body.update(max_tokens=rng.randint(48, 96), ignore_eos=True)
    else:
        sp = {**sampling(rng, 48, 96), "ignore_eos": True} if stop_after else sampling(rng)
        path, body = "/generate", {"text": prompt(rng, ctx), "sampling_params": sp, "stream": True}
    n, last, done, fin = 0, None, False, None
    async with client.stream("POST", ctx.url + path, json=body, timeout=TIMEOUT) as r:
        if r.status_code != 200:
            await r.aread()
            return "error", f"HTTP {r.status_code}", describe(path, body, r)
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                last, n = json.loads(line[6:]), n + 1
                if "error" in last:
                    return "error", f"stream_error_{last['error'].get('code')}", describe(path, body, note=line)
                if stop_after and n >= stop_after:
                    return "expected", "disconnected", ""
                if path == "/generate":
                    fin = (last["meta_info"].get("finish_reason") or {}).get("type")
                else:
                    fin = next((c["finish_reason"] for c in last["choices"] if c.get("finish_reason")), fin)
    if not done or fin not in ("stop", "length"):
        return "error", f"stream_end_{fin}", describe(path, body, note=f" ({n} chunks, [DONE] {done}): {last}"[:400])
    return "ok", kind, ""


async def op_abort(ctx: Ctx, client: httpx.AsyncClient, rng: random.Random, kind: str):
    rid = f"soak-{uuid.UUID(int=rng.getrandbits(128)).hex}"
    body = {"text": prompt(rng, ctx), "rid": rid,
            "sampling_params": {"max_new_tokens": rng.randint(48, 128), "temperature": 0.0, "ignore_eos": True}}
    gen = asyncio.ensure_future(client.post(ctx.url + "/generate", json=body, timeout=TIMEOUT))
    await asyncio.sleep(rng.uniform(0.1, 1.5))
    try:
        a = await client.post(ctx.url + "/abort_request", json={"rid": rid}, timeout=60)
    finally:
        r = await gen
    if a.status_code not in (200, 404):
        return "error", f"abort_request HTTP {a.status_code}", describe("/abort_request", {"rid": rid}, a)
    if r.status_code != 200:
        return "error", f"HTTP {r.status_code}", describe("/generate", body, r, f" (abort answered {a.status_code})")
    if r.json()["meta_info"]["finish_reason"]["type"] == "abort":
        return ("expected", "aborted", "") if a.status_code == 200 else (
            "error", "aborted_after_404", describe("/generate", body, r))
    return "expected", "abort_404" if a.status_code == 404 else "abort_late", ""


async def op_flush(ctx: Ctx, client: httpx.AsyncClient, rng: random.Random, kind: str):
    r = await client.post(ctx.url + "/flush_cache", timeout=60)
    if r.status_code in (200, 400):
        return ("ok", kind, "") if r.status_code == 200 else ("expected", "flush_refused", "")
    return "error", f"HTTP {r.status_code}", describe("/flush_cache", None, r)


OPS = {"gen": op_plain, "chat": op_plain, "score": op_plain, "gen_stream": op_stream, "chat_stream": op_stream,
       "disc_stream": lambda c, cl, rng, k: op_stream(c, cl, rng, k, stop_after=rng.randint(1, 5)),
       "disc_cancel": op_plain, "abort": op_abort, "flush": op_flush}


async def worker(ctx: Ctx, client: httpx.AsyncClient, rng: random.Random, sem: asyncio.Semaphore, t_end: float):
    while time.monotonic() < t_end:
        kind = rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
        async with sem:
            try:
                cat, label, detail = await OPS[kind](ctx, client, rng, kind)
            except (httpx.HTTPError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as e:
                cat, label, detail = "error", type(e).__name__, f"{kind}: {e!r}"[:600]
        ctx.add(kind, cat, label, detail)


def rss_tree(pid: Optional[int]) -> Dict[int, float]:
    """VmRSS in MiB of `pid` and of every descendant ({} without a pid)."""
    out, todo = {}, [pid] if pid else []
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                out[p] = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += map(int, f.read().split())
        except (OSError, StopIteration):
            pass
    return out


def listening_pid(port: int) -> Optional[int]:
    """The pid of the process with a LISTEN socket on `port` (/proc/net/tcp{,6} and /proc/*/fd)."""
    inodes = {f"socket:[{c[9]}]" for name in ("/proc/net/tcp", "/proc/net/tcp6") for c in map(str.split, open(name))
              if c[3] == "0A" and int(c[1].rsplit(":", 1)[1], 16) == port}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            if inodes & {os.readlink(f"/proc/{d}/fd/{fd}") for fd in os.listdir(f"/proc/{d}/fd")}:
                return int(d)
        except OSError:
            pass
    return None


async def pool_state(client: httpx.AsyncClient, url: str) -> dict:
    r = await client.get(url + "/get_server_info", timeout=120)
    r.raise_for_status()
    return {k: v for k, v in r.json()["internal_states"][0].items() if k in POOL_KEYS}


def fmt(c: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"


async def make_row(ctx: Ctx, client: httpx.AsyncClient, pid: Optional[int], label: str,
                   t_min: Optional[float] = None) -> dict:
    try:
        st = await pool_state(client, ctx.url)
    except (httpx.HTTPError, KeyError, ValueError) as e:
        st = {}
        ctx.add("get_server_info", "error", type(e).__name__, repr(e)[:300])
    rss, (tally, ctx.interval) = rss_tree(pid), (ctx.interval, Tally())
    row = {"min": label, "t_min": t_min, "ok": dict(tally.ok), "expected": dict(tally.expected),
           "errors": dict(tally.errors), "pool": st, "rss_mib": round(sum(rss.values()), 1) if rss else None,
           "rss_by_pid": {str(p): round(v, 1) for p, v in rss.items()}}
    g = lambda k: st.get(k, "?")  # noqa: E731
    row["line"] = (f"| {label} | {fmt(tally.ok)} | {fmt(tally.expected)} | {fmt(tally.errors)} | "
                   f"{'/'.join(str(g(k)) for k in POOL_KEYS[:5])} | {g('num_running_reqs')}/{g('num_waiting_reqs')}, "
                   f"{g('req_slots_free')}/{g('max_running_requests')} | {g('memory_errors')} | "
                   f"{row['rss_mib'] or 'n/a'} |")
    print(row["line"], flush=True)
    return row


async def drain_and_check(ctx: Ctx, client: httpx.AsyncClient, timeout: float):
    """Wait for an idle pool, run the leak checks; (failures, idle state before the flush, state after it)."""
    deadline = time.monotonic() + timeout
    while True:
        st = await pool_state(client, ctx.url)
        if not any(st[k] for k in ("num_running_reqs", "num_waiting_reqs", "kv_tokens_in_use", "kv_tokens_protected")):
            break
        if time.monotonic() > deadline:
            return [f"pool not idle after {timeout:.0f} s: {st}"], st, None
        await asyncio.sleep(1.0)
    bad = [msg for ok, msg in [
        (st["kv_tokens_free"] + st["kv_tokens_cached"] == st["kv_tokens_total"],
         "free {kv_tokens_free} + cached {kv_tokens_cached} != total {kv_tokens_total}"),
        (st["req_slots_free"] == st["max_running_requests"],
         "req_slots_free {req_slots_free} != max_running_requests {max_running_requests}"),
        (st["memory_errors"] == 0, "memory_errors {memory_errors}")] if not ok]
    bad = [m.format(**st) for m in bad]
    r = await client.post(ctx.url + "/flush_cache", timeout=60)
    after = await pool_state(client, ctx.url)
    if r.status_code != 200:
        bad.append(f"idle /flush_cache answered {r.status_code} {r.text[:200]!r}")
    elif after["kv_tokens_free"] != after["kv_tokens_total"]:
        bad.append(f"after the flush: free {after['kv_tokens_free']} != total {after['kv_tokens_total']}")
    return bad, st, after


def start_server(extra: List[str], timeout: float):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sgl_jax.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--enable-metrics", *extra]
    log = tempfile.NamedTemporaryFile("w", prefix="soak-server-", suffix=".log", delete=False)
    proc, url, t0 = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}", time.time()
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() - t0 > timeout:
            proc.kill()
            sys.exit(f"server did not start (log {log.name}):\n" + open(log.name).read()[-3000:])
        time.sleep(2)
    print(f"server ready in {time.time() - t0:.0f} s: {url}, pid {proc.pid}, log {log.name}", flush=True)
    return proc, url, log.name, " ".join(shlex.quote(a) for a in ["python", *cmd[1:]])


def machine() -> str:
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    with open("/proc/meminfo") as f:
        mem = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal:"))) / 2 ** 20
    return f"{cpu}, nproc {os.cpu_count()}, {mem:.1f} GiB memory, Python {sys.version.split()[0]}"


def rss_verdict(rows: List[dict], warmup_min: float) -> str:
    after = lambda r: r["t_min"] is None or r["t_min"] > warmup_min + 1e-9  # noqa: E731 ("end": None)
    warm = [r["rss_mib"] for r in rows if r["rss_mib"] and not after(r)]
    post = [r["rss_mib"] for r in rows if r["rss_mib"] and after(r)]
    if not warm or not post:
        return "RSS flat: n/a (no RSS rows within and after the warm-up)"
    g = 100 * (max(post) - warm[-1]) / warm[-1]
    return (f"RSS flat: {'yes' if g <= 5 else 'no'} (growth {g:.1f}% {'<=' if g <= 5 else '>'} 5%; "
            f"{warm[-1]:.0f} MiB at the end of the warm-up, max {max(post):.0f} MiB after)")


async def soak(args, url: str, pid: Optional[int], labels: List[int]) -> dict:
    ctx = Ctx(url, [words(random.Random(args.seed), n) for n in (40, 120, 220, 290)], labels)
    rows: List[dict] = []
    limits = httpx.Limits(max_connections=4 * args.concurrency + 8, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        print(HEADER, flush=True)
        t0, duration, sem = time.monotonic(), args.duration_min * 60, asyncio.Semaphore(args.concurrency)
        workers = [asyncio.ensure_future(worker(ctx, client, random.Random(args.seed * 1000 + i + 1), sem,
                                                t0 + duration)) for i in range(args.concurrency)]
        for k in range(1, math.ceil(duration / args.interval_s - 1e-9) + 1):  # a row every interval, one at the end
            t = min(k * args.interval_s, duration)
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            rows.append(await make_row(ctx, client, pid, f"{round(t / 60, 2):g}", t / 60))
        _, late = await asyncio.wait(workers, timeout=TIMEOUT.read + 60)
        for w in late:
            w.cancel()
            ctx.add("worker", "error", "hung_past_timeout", "a worker did not finish its last request")
        failures, idle, flushed = await drain_and_check(ctx, client, args.idle_timeout_s)
        rows.append(await make_row(ctx, client, pid, "end"))
        r = await client.get(url + "/get_server_info", timeout=120)
        r.raise_for_status()
    return {"rows": rows, "total": ctx.total, "failures": failures, "idle_state": idle, "after_flush": flushed,
            "prompt_tokens": ctx.prompt_tokens, "cached_tokens": ctx.cached_tokens, "server_info_end": r.json()}


def write_report(args, meta: dict, res: dict, verdicts: List[str]) -> None:
    t: Tally = res["total"]
    rates = MachineRates.from_json(meta["rates"]).describe()
    json_path = os.path.splitext(args.report)[0] + ".json"
    lines = [f"# Soak test ({meta['date']})", "", f"Commit {meta['commit']}; machine: {meta['machine']}; machine "
             f"rates {rates}.", "", f"Generated with its raw output in `{os.path.basename(json_path)}`; not edited "
             f"by hand (notes go in `{os.path.basename(notes_path(args.report))}`).",
             "", "Command:", "", f"    {meta['command']}", "", f"Server: `{meta['server']}`", "",
             f"{args.duration_min:g} min, {args.concurrency} workers, a row every {args.interval_s:g} s, warm-up "
             f"{args.warmup_min:g} min, seed {args.seed}; operation weights {WEIGHTS}. Counts are within each row's "
             "interval; the columns are described in benchmark/soak.py's docstring.", "", HEADER,
             *[r["line"] for r in res["rows"]], "",
             f"Totals: ok {sum(t.ok.values())} ({fmt(t.ok)}); expected {sum(t.expected.values())} "
             f"({fmt(t.expected)}); errors {sum(t.errors.values())} ({fmt(t.errors)}). /generate prompts of "
             f"{res['prompt_tokens'][0]}-{res['prompt_tokens'][1]} tokens; {res['cached_tokens']} prompt tokens of "
             f"non-streaming /generate served from the prefix cache.", "",
             f"Idle pool before the final flush: `{json.dumps(res['idle_state'])}`", "",
             "Server after the final flush (raw /get_server_info in the .json):", "",
             format_server_claims(res["server_info_end"]), "", *[f"**{v}**  " for v in verdicts]]
    if t.samples:
        lines += ["", "First request of each error kind:", ""] + [f"- `{k}`: `{v}`" for k, v in t.samples.items()]
    if meta["server_log_errors"]:
        lines += ["", "Server log ERROR lines (first 10):", ""] + [f"    {x}" for x in meta["server_log_errors"]]
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    with open(args.report, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(json_path, "w") as f:
        json.dump({**meta, "verdicts": verdicts, **{k: v for k, v in res.items() if k != "total"},
                   "totals": {"ok": t.ok, "expected": t.expected, "errors": t.errors}, "error_samples": t.samples},
                  f, indent=2)


def main() -> int:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else None
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("duration-min", 30.0), ("concurrency", 8), ("interval-s", 60.0), ("warmup-min", 5.0),
                          ("seed", 0), ("start-timeout-s", 900.0), ("idle-timeout-s", 180.0)]:
        p.add_argument("--" + name, type=type(default), default=default)
    p.add_argument("--report", default=f"reports/soak-cpu-{datetime.date.today()}.md")
    p.add_argument("--url", help="a running server on loopback (else one is started)")
    p.add_argument("--server-pid", type=int, help="with --url: the server's pid, for RSS")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    commit = git_commit(short=True)  # (at the start: the code a self-started server runs)
    rates = machine_rates_in_subprocess()  # before a self-started server: the machine to itself
    proc, log = None, None
    if args.url:
        url = args.url.rstrip("/")
        if server_args or httpx.URL(url).host not in ("127.0.0.1", "localhost", "::1"):
            p.error("--url takes no server args and must be on loopback")
        pid = args.server_pid or listening_pid(httpx.URL(url).port or 80)
        server = f"running at {url}, pid {pid or 'unknown (RSS omitted)'}"
    else:
        proc, url, log, server = start_server(DEFAULT_SERVER_ARGS if server_args is None else server_args,
                                              args.start_timeout_s)
        pid = proc.pid
    vocab = httpx.get(url + "/get_server_info", timeout=60).json()["scheduler_info"].get("vocab_size", 0)
    labels = [9805, 787] if vocab > 9805 else [1, 2]  # " yes", " no" in SmolLM2's vocabulary
    command = " ".join(shlex.quote(a) for a in ["python", "benchmark/soak.py", *sys.argv[1:]])
    print(f"machine rates {rates.describe()}\nsoak: {command}\nserver: {server}", flush=True)
    code = None
    try:
        res = asyncio.run(soak(args, url, pid, labels))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = f"none: killed after 120 s ({proc.wait()})"
    verdicts = [rss_verdict(res["rows"], args.warmup_min),
                "leaks: " + ("none" if not res["failures"] else "; ".join(res["failures"])),
                f"errors: {sum(res['total'].errors.values())} ({fmt(res['total'].errors)})"]
    verdicts += [f"server exit code after SIGTERM: {code}"] if proc is not None else []
    log_errors = []
    if log:
        with open(log, errors="replace") as f:
            log_errors = [ln.rstrip()[:300] for ln in f if " ERROR " in ln or ln.startswith("Traceback")][:10]
    meta = {"date": str(datetime.date.today()), "commit": commit, "machine": machine(), "command": command,
            "server": server, "server_log": log, "server_log_errors": log_errors, "rates": rates.to_json(),
            "args": vars(args)}
    write_report(args, meta, res, verdicts)
    print("\n".join(verdicts + [f"report: {args.report} (+ .json)"]), flush=True)
    return 1 if res["failures"] or res["total"].errors or (proc is not None and code != 0) else 0


if __name__ == "__main__":
    sys.exit(main())
