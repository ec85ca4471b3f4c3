#!/usr/bin/env python3
"""Load generator for `slowfast serve` (or any OpenAI-compatible server with --openai-compat-only).

Closed loop: --concurrency clients send --requests streaming /v1/completions between them, with
mixed prompt lengths; a --disconnect-fraction of them close the stream after a random number of
chunks. Reports requests/s, output tok/s, time to first token and inter-token latency (p50/p99),
as a table and (--json OUT) as JSON.

Checks (exit status 1 when one fails):
  * every request that was not cancelled returned HTTP 200 and finished with finish_reason
    "length" and exactly --max-tokens completion tokens (needs --ignore-eos, sent as the
    `ignore_eos` extension so the count is exact; without it, at most --max-tokens);
  * unless --openai-compat-only: after the run each /metrics (--metrics-url, repeatable; default
    URL/metrics) settles to slowfast_running_sequences 0, slowfast_queued_sequences 0 and
    slowfast_kv_bytes_in_use equal to its value before the run; the slowfast_requests_total
    counters rose by exactly the requests sent (none as error or rejected); with
    --expect-all-replicas every metrics URL served at least one request.

  python3 bench/serve_load.py --url http://127.0.0.1:8080 --concurrency 64 --max-tokens 64 --ignore-eos
  python3 bench/serve_load.py --url http://127.0.0.1:8080 --token-ids --vocab 151936 ...   (random weights)
  python3 bench/serve_load.py --url http://127.0.0.1:8000 --openai-compat-only ...        (llama_cpp.server)

For the side-by-side, start llama-cpp-python's server on the same GGUF with the same cores, e.g.
  python3 -m llama_cpp.server --model ~/.cache/slowfast/models/gemma-3-270m-q4_k_m.gguf \
      --model_alias gemma3-270m --n_threads 2 --n_ctx 2048 --port 8000 --interrupt_requests False
(--interrupt_requests False: by default it aborts a running stream whenever a new request
arrives, so every concurrent request but the last fails). It serves one request at a time.

--openai-compat-only sends only fields llama.cpp's servers accept (with --ignore-eos: `min_tokens`
= max_tokens for `python3 -m llama_cpp.server`, `ignore_eos` for llama-server), skips /metrics,
and counts tokens from `usage` when the server streams it, else one per text chunk.
Uses asyncio + httpx when httpx is installed, else threads + http.client (stdlib only).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

try:
    import httpx  # type: ignore
except ImportError:  # pragma: no cover - exercised on machines without httpx
    httpx = None

# ------------------------------------------------------------------------------------- prompts
_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when what if will more "
    "no out so said up about into than them can only other new some time could these two may then "
    "first any like now my such make over our even most made after also did many before must through "
    "years where much way well down should because each just those people how too little state good "
    "very world still own see men work long here get both between life being under never day same "
    "another know while last might great old year off come since against go came right used take "
    "three small house river city water light stone road morning evening harbour market window garden "
    "letter mountain village winter summer autumn spring storm ship sailor builder keeper lamp tower"
).split()


def prose_prompt(approx_tokens: int, rng: random.Random) -> str:
    """Deterministic English-like prose of about `approx_tokens` tokens (Gemma 3: ~1.12 tokens a word)."""
    n_words = max(1, round(approx_tokens / 1.12))
    out, sentence = [], []
    for _ in range(n_words):
        w = rng.choice(_WORDS)
        sentence.append(w.capitalize() if not sentence else w)
        if len(sentence) >= rng.randint(8, 16):
            out.append(" ".join(sentence) + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence))
    return " ".join(out)


def file_prompt(path: str, approx_tokens: int, rng: random.Random) -> str:
    """A slice of the text file `path` of about `approx_tokens` tokens (~4 characters a
    token in English prose), starting at a line chosen by `rng`."""
    text = _texts.get(path)
    if text is None:
        text = _texts[path] = open(path, encoding="utf-8", errors="replace").read()
    n = approx_tokens * 4
    if len(text) <= n:
        return text
    start = text.find("\n", rng.randrange(len(text) - n)) + 1
    return text[start:start + n]


_texts: dict[str, str] = {}


def make_prompt(args, i: int, L: int, rr: random.Random):
    if args.token_ids:
        return [rr.randrange(args.token_id_min, args.vocab) for _ in range(L)]
    if args.prompt_file:
        return file_prompt(args.prompt_file, L, rr)
    return f"Request {i}. " + prose_prompt(L, rr)


# ------------------------------------------------------------------------------------- results
@dataclass
class Result:
    index: int
    prompt_tokens_target: int
    disconnect_after: int | None  # token chunks to read before closing (None: read to the end)
    status: int | None = None
    error: str | None = None
    cancelled: bool = False       # we closed the stream on purpose
    done: bool = False            # saw data: [DONE]
    finish_reason: str | None = None
    chunks: int = 0               # chunks carrying text or tokens
    tokens: int = 0               # tokens counted from token_ids (or one per text chunk)
    token_ids_seen: bool = False
    usage: dict | None = None
    slowfast: dict | None = None
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    itl: list = field(default_factory=list)
    arrivals: list = field(default_factory=list)  # (time, tokens) of each chunk
    _last: float | None = None

    def feed(self, line: str, now: float, compat: bool) -> bool:
        """One SSE line; returns False when the client should stop reading."""
        if self.done:
            if line.strip():
                self.error = f"data after [DONE]: {line[:200]!r}"
                return False
            return True
        line = line.strip()
        if not line or line.startswith(":"):
            return True
        if not line.startswith("data:"):
            return True  # event:/id: lines are not used by OpenAI streams
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return True  # read on to the end of the body, so the connection can be reused
        try:
            obj = json.loads(payload)
        except ValueError:
            self.error = f"bad SSE payload: {payload[:200]!r}"
            return False
        if "error" in obj and not obj.get("choices"):
            self.error = f"error event: {json.dumps(obj)[:300]}"
            return False
        if obj.get("usage"):
            self.usage = obj["usage"]
        if obj.get("slowfast"):
            self.slowfast = obj["slowfast"]
        for ch in obj.get("choices") or []:
            ids = ch.get("token_ids")
            text = ch.get("text")
            if text is None:
                text = (ch.get("delta") or {}).get("content")
            n = 0
            if isinstance(ids, list) and not compat:
                self.token_ids_seen = True
                n = len(ids)
            elif text:
                n = 1
            if n:
                if self.first is None:
                    self.first = now
                elif self._last is not None:
                    self.itl.append((now - self._last) / n)
                self._last = now
                self.arrivals.append((now, n))
                self.chunks += 1
                self.tokens += n
            if ch.get("finish_reason"):
                self.finish_reason = ch["finish_reason"]
        if self.disconnect_after is not None and self.chunks >= self.disconnect_after and not self.finish_reason:
            self.cancelled = True
            return False
        return True

    def completion_tokens(self) -> int | None:
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return None


# ------------------------------------------------------------------------------------- clients
def _request_body(args, prompt, i: int) -> dict:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed * 1_000_003 + i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.openai_compat_only:
        if args.ignore_eos:
            body["min_tokens"] = args.max_tokens  # python3 -m llama_cpp.server
            body["ignore_eos"] = True             # llama-server
    else:
        body["return_token_ids"] = True
        if args.ignore_eos:
            body["ignore_eos"] = True
        if args.kv_policy:
            body["kv_policy"] = args.kv_policy
    return body


def _headers(args) -> dict:
    h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if args.api_key:
        h["Authorization"] = f"Bearer {args.api_key}"
    return h


async def _run_httpx(args, plan):
    import asyncio

    results = []
    queue = list(reversed(plan))
    timeout = httpx.Timeout(args.timeout, connect=min(30.0, args.timeout))
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=_headers(args)) as client:
        async def one(item):
            i, prompt, res = item
            res.start = time.perf_counter()
            try:
                async with client.stream("POST", args.url + "/v1/completions",
                                         content=json.dumps(_request_body(args, prompt, i))) as resp:
                    res.status = resp.status_code
                    if resp.status_code != 200:
                        body = (await resp.aread()).decode("utf-8", "replace")
                        res.error = f"HTTP {resp.status_code}: {body[:300]}"
                    else:
                        async for line in sse_lines(resp.aiter_bytes()):
                            if not res.feed(line, time.perf_counter(), args.openai_compat_only):
                                break
            except Exception as e:  # noqa: BLE001 - recorded per request
                if not res.cancelled:
                    res.error = f"{type(e).__name__}: {e}"
            res.end = time.perf_counter()
            results.append(res)

        async def worker():
            while queue:
                await one(queue.pop())

        async def probe():
            # Once every stream of the first wave is decoding, one more short request: its time
            # to first token is the TTFT of a newcomer while the others decode.
            first_wave = [res for (_, _, res) in plan[: args.concurrency]]
            while not all(r.first is not None or r.end for r in first_wave):
                await asyncio.sleep(0.02)
            await asyncio.sleep(args.probe_delay)
            i = len(plan)
            rr = random.Random(args.seed * 7919 + i)
            L = args.probe
            prompt = make_prompt(args, i, L, rr)
            res = Result(index=i, prompt_tokens_target=L, disconnect_after=None)
            await one((i, prompt, res))
            results.remove(res)  # one() records it; the probe is reported apart
            probes.append(res)

        probes = []
        jobs = [worker() for _ in range(min(args.concurrency, len(plan)))]
        if args.probe:
            jobs.append(probe())
        await asyncio.gather(*jobs)
    args.probe_results = probes
    return results


def _run_threads(args, plan):
    import http.client

    u = urllib.parse.urlsplit(args.url)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    lock = threading.Lock()
    queue = list(reversed(plan))
    results = []

    def one(item):
        i, prompt, res = item
        res.start = time.perf_counter()
        conn = conn_cls(u.hostname, u.port, timeout=args.timeout)
        try:
            conn.request("POST", (u.path.rstrip("/") or "") + "/v1/completions",
                         body=json.dumps(_request_body(args, prompt, i)).encode(), headers=_headers(args))
            resp = conn.getresponse()
            res.status = resp.status
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {resp.read()[:300].decode('utf-8', 'replace')}"
            else:
                while True:
                    raw = resp.readline()
                    if not raw:
                        break
                    if not res.feed(raw.decode("utf-8", "replace"), time.perf_counter(), args.openai_compat_only):
                        break
        except Exception as e:  # noqa: BLE001
            if not res.cancelled:
                res.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        res.end = time.perf_counter()
        with lock:
            results.append(res)

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                item = queue.pop()
            one(item)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(args.concurrency, len(plan)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# ------------------------------------------------------------------------------------- metrics
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


async def sse_lines(chunks):
    """An SSE body's lines, split on b"\n" only and decoded as UTF-8 (SSE's encoding).

    httpx's aiter_lines splits with str.splitlines, which also breaks at U+2028, U+0085 and other
    characters that generated text may hold; one such character would cut a JSON payload in two.
    """
    buf = b""
    async for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", "replace")


def scrape(url: str, api_key: str | None = None, timeout: float = 10) -> dict:
    """/metrics as {(name, ((label, value), ...)): float}."""
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode("utf-8", "replace")
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            try:
                out[(m.group(1), tuple(sorted(_LABEL.findall(m.group(3) or ""))))] = float(m.group(4))
            except ValueError:
                pass
    return out


def mget(m: dict, name: str, default=None, **labels):
    want = set(labels.items())
    vals = [v for (n, ls), v in m.items() if n == name and want <= set(ls)]
    return sum(vals) if vals else default


def outcomes(m: dict) -> dict:
    out = {}
    for (n, ls), v in m.items():
        if n == "slowfast_requests_total":
            o = dict(ls).get("outcome", "")
            out[o] = out.get(o, 0) + v
    return out


# ------------------------------------------------------------------------------------- stats
def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(xs):
    return {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99),
            "mean": statistics.fmean(xs) if xs else None, "max": max(xs) if xs else None}


def num(v):
    return "-" if v is None else f"{v:g}"


def fmt_ms(v):
    return "-" if v is None else f"{v * 1000:.1f}"


# ------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (without /v1)")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, help="total requests (default: 2 x concurrency)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, disconnects and per-request seeds")
    p.add_argument("--prompt-lengths", default="16,128,512", help="approximate prompt tokens, cycled over requests")
    p.add_argument("--token-ids", action="store_true", help="send random token-id prompts (random-weight models)")
    p.add_argument("--prompt-file", metavar="PATH",
                   help="prompts are slices of this text file (real prose) instead of generated words")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size for --token-ids")
    p.add_argument("--token-id-min", type=int, default=10, help="smallest id drawn for --token-ids (skips specials)")
    p.add_argument("--disconnect-fraction", type=float, default=0.25)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens")
    p.add_argument("--kv-policy", type=json.loads, help='extension kv_policy as JSON, e.g. \'{"name":"sfi","kv_budget":300}\'')
    p.add_argument("--api-key")
    p.add_argument("--timeout", type=float, default=600, help="per-request read timeout (s)")
    p.add_argument("--metrics-url", action="append", default=[],
                   help="a /metrics URL to check (repeatable: one per replica behind a front; default URL/metrics)")
    p.add_argument("--expect-all-replicas", action="store_true", help="every --metrics-url must have served requests")
    p.add_argument("--settle-timeout", type=float, default=10, help="seconds to wait for /metrics to return to idle")
    p.add_argument("--openai-compat-only", action="store_true",
                   help="no extensions but what llama.cpp's servers accept, no /metrics checks")
    p.add_argument("--probe", type=int, metavar="TOKENS",
                   help="once the first wave is decoding, send one more request with a prompt of TOKENS "
                        "tokens and report its time to first token (httpx only)")
    p.add_argument("--probe-delay", type=float, default=1.0, help="seconds to wait before the probe")
    p.add_argument("--threads", action="store_true", help="use threads + http.client even when httpx is installed")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the report as JSON to OUT")
    a = p.parse_args(argv)
    a.url = a.url.rstrip("/")
    if a.url.endswith("/v1"):
        a.url = a.url[:-3]
    if a.requests is None:
        a.requests = 2 * a.concurrency
    if a.concurrency < 1 or a.requests < 1 or a.max_tokens < 1:
        p.error("--concurrency, --requests and --max-tokens must be at least 1")
    if not 0 <= a.disconnect_fraction <= 1:
        p.error("--disconnect-fraction must be in [0, 1]")
    try:
        a.lengths = [int(x) for x in a.prompt_lengths.split(",") if x.strip()]
    except ValueError:
        p.error("--prompt-lengths: comma-separated integers")
    if not a.lengths or min(a.lengths) < 1:
        p.error("--prompt-lengths: positive integers")
    if a.openai_compat_only:
        if a.token_ids:
            p.error("--token-ids is not OpenAI-compatible enough for llama.cpp's server; drop --openai-compat-only")
        if a.kv_policy:
            p.error("--kv-policy is an extension; drop --openai-compat-only")
        if a.metrics_url or a.expect_all_replicas:
            p.error("--openai-compat-only skips the /metrics checks")
    elif not a.metrics_url:
        a.metrics_url = [a.url + "/metrics"]
    return a


def get_model(args) -> str:
    req = urllib.request.Request(args.url + "/v1/models", headers=_headers(args))
    with urllib.request.urlopen(req, timeout=30) as r:
        data = json.load(r)
    return data["data"][0]["id"]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model is None:
        args.model = get_model(args)
    rng = random.Random(args.seed)
    n_disc = round(args.disconnect_fraction * args.requests) if args.max_tokens > 1 else 0
    disconnecting = set(rng.sample(range(args.requests), n_disc))
    plan = []
    for i in range(args.requests):
        L = args.lengths[i % len(args.lengths)]
        r = random.Random(args.seed * 7919 + i)
        prompt = make_prompt(args, i, L, r)
        disc = rng.randint(1, args.max_tokens - 1) if i in disconnecting else None
        plan.append((i, prompt, Result(index=i, prompt_tokens_target=L, disconnect_after=disc)))
    rng.shuffle(plan)  # mix the lengths and the disconnects over time

    failures: list[str] = []
    check_metrics = not args.openai_compat_only
    before = {}
    if check_metrics:
        for u in args.metrics_url:
            try:
                before[u] = scrape(u, args.api_key)
            except Exception as e:  # noqa: BLE001
                print(f"error: cannot read {u}: {e}", file=sys.stderr)
                return 2

    transport = "httpx+asyncio" if (httpx is not None and not args.threads) else "threads+http.client"
    print(f"load: {args.requests} requests, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          f"prompts ~{args.lengths} {'token ids' if args.token_ids else ('tokens of ' + args.prompt_file) if args.prompt_file else 'tokens of prose'}, "
          f"disconnect {args.disconnect_fraction:.0%}, ignore_eos {args.ignore_eos}, model {args.model!r}, "
          f"{transport} -> {args.url}", flush=True)
    t0 = time.perf_counter()
    if transport.startswith("httpx"):
        import asyncio
        results = asyncio.run(_run_httpx(args, plan))
    else:
        results = _run_threads(args, plan)
    wall = time.perf_counter() - t0
    results.sort(key=lambda r: r.index)

    # ---- per-request checks
    completed = [r for r in results if not r.cancelled]
    cancelled = [r for r in results if r.cancelled]
    bad = []
    for r in completed:
        why = None
        n_usage = r.completion_tokens()
        if r.error:
            why = r.error
        elif r.status != 200:
            why = f"HTTP {r.status}"
        elif not r.done and not args.openai_compat_only:
            why = "stream ended without data: [DONE]"
        elif args.ignore_eos and r.finish_reason != "length":
            why = f"finish_reason {r.finish_reason!r}, want 'length'"
        elif r.finish_reason not in ("length", "stop"):
            why = f"finish_reason {r.finish_reason!r}"
        elif not args.openai_compat_only:
            if n_usage is None:
                why = "no usage chunk (stream_options.include_usage)"
            elif args.ignore_eos and n_usage != args.max_tokens:
                why = f"usage.completion_tokens {n_usage}, want {args.max_tokens}"
            elif n_usage > args.max_tokens:
                why = f"usage.completion_tokens {n_usage} > max_tokens {args.max_tokens}"
            elif r.token_ids_seen and r.tokens != n_usage:
                why = f"{r.tokens} streamed token_ids but usage.completion_tokens {n_usage}"
            elif r.slowfast is None:
                why = "the last chunk has no `slowfast` object"
        else:
            n = n_usage if n_usage is not None else r.tokens
            if args.ignore_eos and n_usage is not None and n_usage != args.max_tokens:
                why = f"usage.completion_tokens {n_usage}, want {args.max_tokens}"
            elif n > args.max_tokens:
                why = f"{n} completion tokens > max_tokens {args.max_tokens}"
        if why:
            bad.append((r, why))
    if bad:
        failures.append(f"{len(bad)} of {len(results)} requests failed; first ones:")
        for r, why in bad[:10]:
            failures.append(f"  request {r.index} (prompt ~{r.prompt_tokens_target} tokens"
                            f"{', disconnecting' if r.disconnect_after else ''}): {why}")

    # ---- metrics checks
    replicas = []
    if check_metrics:
        deadline = time.monotonic() + args.settle_timeout
        pending = set(args.metrics_url)
        after = {}
        while True:
            for u in list(pending):
                try:
                    m = scrape(u, args.api_key)
                except Exception as e:  # noqa: BLE001
                    after[u] = {}
                    failures.append(f"{u}: {e}")
                    pending.discard(u)
                    continue
                after[u] = m
                if (mget(m, "slowfast_running_sequences") == 0 and mget(m, "slowfast_queued_sequences") == 0
                        and mget(m, "slowfast_kv_bytes_in_use") == mget(before[u], "slowfast_kv_bytes_in_use")):
                    pending.discard(u)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        total_delta = 0.0
        for u in args.metrics_url:
            b, m = before[u], after.get(u, {})
            if not m:
                continue
            ob, oa = outcomes(b), outcomes(m)
            d = {k: oa.get(k, 0) - ob.get(k, 0) for k in set(ob) | set(oa)}
            served = sum(d.values())
            total_delta += served
            rep = {
                "metrics_url": u,
                "requests_delta": d,
                "prompt_tokens_delta": (mget(m, "slowfast_prompt_tokens_total", 0) - mget(b, "slowfast_prompt_tokens_total", 0)),
                "generation_tokens_delta": (mget(m, "slowfast_generation_tokens_total", 0) - mget(b, "slowfast_generation_tokens_total", 0)),
                "sfi_steps_delta": {k: mget(m, "slowfast_sfi_steps_total", 0, kind=k) - mget(b, "slowfast_sfi_steps_total", 0, kind=k)
                                    for k in ("slow", "fast")},
                "running_after": mget(m, "slowfast_running_sequences"),
                "queued_after": mget(m, "slowfast_queued_sequences"),
                "kv_bytes_in_use_before": mget(b, "slowfast_kv_bytes_in_use"),
                "kv_bytes_in_use_after": mget(m, "slowfast_kv_bytes_in_use"),
                "kv_bytes_free_after": mget(m, "slowfast_kv_bytes_free"),
            }
            replicas.append(rep)
            for name in ("slowfast_running_sequences", "slowfast_queued_sequences", "slowfast_kv_bytes_in_use"):
                if mget(m, name) is None:
                    failures.append(f"{u}: no {name}")
            if rep["running_after"] not in (0, None):
                failures.append(f"{u}: slowfast_running_sequences {rep['running_after']} after the run (want 0)")
            if rep["queued_after"] not in (0, None):
                failures.append(f"{u}: slowfast_queued_sequences {rep['queued_after']} after the run (want 0)")
            if rep["kv_bytes_in_use_after"] != rep["kv_bytes_in_use_before"]:
                failures.append(f"{u}: slowfast_kv_bytes_in_use {rep['kv_bytes_in_use_after']} after the run, "
                                f"{rep['kv_bytes_in_use_before']} before")
            for o in ("error", "rejected"):
                if d.get(o, 0):
                    failures.append(f"{u}: slowfast_requests_total{{outcome=\"{o}\"}} rose by {d[o]:g}")
            if args.expect_all_replicas and served <= 0:
                failures.append(f"{u}: served no request (slowfast_requests_total unchanged) with --expect-all-replicas")
        sent = len(results) + len(getattr(args, "probe_results", []))
        if total_delta != sent:
            failures.append(f"slowfast_requests_total rose by {total_delta:g} over {len(args.metrics_url)} metrics URL(s); "
                            f"{sent} requests were sent")
        ok_delta = sum(r["requests_delta"].get("ok", 0) for r in replicas)
        n_ok = len(completed) - len([1 for r, _ in bad if not r.cancelled])
        if ok_delta < n_ok:
            failures.append(f"slowfast_requests_total{{outcome=\"ok\"}} rose by {ok_delta:g}, but {n_ok} requests completed")
        gen_delta = sum(r["generation_tokens_delta"] for r in replicas)
        want_gen = sum(r.completion_tokens() or 0 for r in completed)
        if gen_delta < want_gen:
            failures.append(f"slowfast_generation_tokens_total rose by {gen_delta:g}, "
                            f"but completed requests alone report {want_gen} tokens")

    # ---- report
    out_tokens = sum((r.completion_tokens() if r.completion_tokens() is not None else r.tokens) for r in completed) \
        + sum(r.tokens for r in cancelled)
    ttft = [r.first - r.start for r in results if r.first is not None]
    itl = [x for r in results for x in r.itl]
    e2e = [r.end - r.start for r in completed if r.status == 200 and not r.error]
    # Steady decode rate: while every stream of the run is decoding (from the last first token
    # to the first end), the tokens that arrived over that window; meaningful for one wave
    # (--requests == --concurrency) without disconnects, where it compares to `bench --batch`.
    steady = None
    firsts = [r.first for r in results if r.first is not None]
    if completed and len(firsts) == len(results):
        lo, hi = max(firsts), min(r.end for r in completed)
        if hi > lo:
            n = sum(k for r in results for (t, k) in r.arrivals if lo < t <= hi)
            steady = {"window_s": hi - lo, "tokens": n, "tok_per_s": n / (hi - lo)}
    prompt_actual = {}
    for r in results:
        if r.usage and isinstance(r.usage.get("prompt_tokens"), int):
            prompt_actual.setdefault(r.prompt_tokens_target, []).append(r.usage["prompt_tokens"])
    prompt_actual = {k: statistics.fmean(v) for k, v in sorted(prompt_actual.items())}
    report = {
        "url": args.url, "model": args.model, "transport": transport,
        "concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens,
        "prompt_lengths": args.lengths, "token_ids": args.token_ids, "ignore_eos": args.ignore_eos,
        "disconnect_fraction": args.disconnect_fraction, "kv_policy": args.kv_policy,
        "openai_compat_only": args.openai_compat_only,
        "completed": len(completed), "cancelled": len(cancelled), "failed": len(bad),
        "wall_s": wall,
        "requests_per_s": len(completed) / wall if wall else None,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall if wall else None,
        "ttft_s": summary(ttft), "itl_s": summary(itl), "e2e_s": summary(e2e),
        "steady_decode": steady,
        "prompt_tokens_by_target": prompt_actual,
        "replicas": replicas,
        "failures": failures,
        "passed": not failures,
    }
    print()
    print(f"{'requests':<24}{len(results)} sent, {len(completed)} not cancelled ({len(completed) - len(bad)} ok, "
          f"{len(bad)} failed), {len(cancelled)} cancelled by the client")
    print(f"{'wall time':<24}{wall:.2f} s")
    print(f"{'requests/s':<24}{report['requests_per_s']:.2f}   (requests not cancelled)")
    print(f"{'output tok/s':<24}{report['output_tok_per_s']:.1f}   ({out_tokens} tokens, cancelled included)")
    probes = getattr(args, "probe_results", [])
    if probes:
        pr = probes[0]
        report["probe"] = {"prompt_tokens": pr.completion_tokens() and pr.usage.get("prompt_tokens"),
                           "ttft_s": (pr.first - pr.start) if pr.first is not None else None,
                           "error": pr.error}
        if pr.error or pr.first is None:
            failures.append(f"the probe request failed: {pr.error}")
        else:
            print(f"{'probe TTFT':<24}{(pr.first - pr.start) * 1e3:.1f} ms   (a ~{args.probe}-token prompt "
                  f"arriving while the others decode)")
    if steady:
        print(f"{'steady decode tok/s':<24}{steady['tok_per_s']:.1f}   (every stream decoding: "
              f"{steady['tokens']} tokens in {steady['window_s']:.2f} s)")
    print(f"{'':<24}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'max ms':>10}{'n':>8}")
    for name, s in (("time to first token", report["ttft_s"]), ("inter-token latency", report["itl_s"]),
                    ("request latency", report["e2e_s"])):
        print(f"{name:<24}{fmt_ms(s['p50']):>10}{fmt_ms(s['p99']):>10}{fmt_ms(s['mean']):>10}{fmt_ms(s['max']):>10}{s['n']:>8}")
    if prompt_actual:
        print(f"{'prompt tokens':<24}" + ", ".join(f"~{k}: {v:.0f}" for k, v in prompt_actual.items())
              + "   (target: mean usage.prompt_tokens)")
    for rep in replicas:
        d = ", ".join(f"{k or '?'} {v:g}" for k, v in sorted(rep["requests_delta"].items()))
        print(f"{'metrics':<24}{rep['metrics_url']}: requests {{{d}}}, generated {num(rep['generation_tokens_delta'])} "
              f"tokens, running {num(rep['running_after'])}, queued {num(rep['queued_after'])}, "
              f"kv in use {num(rep['kv_bytes_in_use_after'])} (before {num(rep['kv_bytes_in_use_before'])})")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"{'json':<24}{args.json_out}")
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for f_ in failures:
            print("  " + f_, file=sys.stderr)
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
