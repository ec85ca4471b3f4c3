#!/usr/bin/env python3
"""Prefix-cache benchmark for `slowfast serve`: N requests that share one long system prompt.

Starts the server twice on the same model and flags, once with the prefix cache off
(--prefix-cache-memory 0) and once with it on (the default), or with --baseline BIN once with
BIN and once with --slowfast, the cache on in both (two builds compared), sends the N requests at once
(streaming /v1/completions, greedy, --max-tokens each), and reports per run: time to first token
(mean, p50, max), the wall time of the burst, prompt tokens prefilled and restored from the cache,
and the KV bytes (running sequences, at the end of the burst, and the prefix cache) from /metrics.
Exits 1 unless both runs return the same text for every request.

  python3 bench/prefix_cache.py --slowfast target/release/slowfast --model gemma3-270m \\
      --system-file data/texts/austen_prideprejudice.txt --system-tokens 8192 --requests 32
Stdlib only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time

from serve_metrics import free_port, metrics


def one(port: int, model: str, prompt: str, max_tokens: int, t0: float, out: dict) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        out["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
        return
    text = []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for ch in chunk.get("choices", []):
            # The first chunk is the first token, even when it decodes to no text yet (a
            # random-weight model's byte-level tokens).
            out.setdefault("ttft", time.perf_counter() - t0)
            if ch.get("text"):
                text.append(ch["text"])
    out["text"] = "".join(text)
    out["end"] = time.perf_counter() - t0


def run(args, system: str, cache_on: bool, binary: str | None = None) -> dict:
    port = free_port()
    cmd = [binary or args.slowfast, "serve", "--model", args.model, "--port", str(port),
           "--max-batch", str(args.max_batch), "--max-context", str(args.max_context),
           "--max-queue", str(args.requests + 8)]
    if not cache_on:
        cmd += ["--prefix-cache-memory", "0"]
    cmd += args.serve_arg
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                metrics(port)
                break
            except OSError:
                if srv.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"the server did not start: {srv.stderr.read()[-2000:]}")
                time.sleep(0.5)
        model = args.served_name or args.model
        before = metrics(port)
        prompts = [f"{system}\n\nQuestion {i + 1}: what happens in chapter {i + 1}? Answer:"
                   for i in range(args.requests)]
        outs = [dict() for _ in prompts]
        peak = {"kv": 0.0}
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                try:
                    peak["kv"] = max(peak["kv"], metrics(port).get("slowfast_kv_bytes_in_use", 0))
                except OSError:
                    pass
                stop.wait(0.5)

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        t0 = time.perf_counter()
        ts = [threading.Thread(target=one, args=(port, model, p, args.max_tokens, t0, o))
              for p, o in zip(prompts, outs)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        wall = time.perf_counter() - t0
        stop.set()
        after = metrics(port)
        errors = [o["error"] for o in outs if "error" in o]
        if errors:
            raise SystemExit(f"{len(errors)} requests failed: {errors[0]}")
        ttft = [o["ttft"] for o in outs]
        d = lambda k: after.get(k, 0) - before.get(k, 0)
        return {
            "label": binary or ("on" if cache_on else "off"),
            "prefix_cache": cache_on,
            "requests": args.requests,
            "ttft_mean_s": statistics.mean(ttft),
            "ttft_p50_s": statistics.median(ttft),
            "ttft_max_s": max(ttft),
            "wall_s": wall,
            "prefill_tokens": d("slowfast_prefill_tokens_total"),
            "prefix_hit_tokens": d("slowfast_prefix_cache_hit_tokens_total"),
            "kv_bytes_in_use_peak": peak["kv"],
            "prefix_cache_bytes": after.get("slowfast_prefix_cache_bytes", 0),
            "texts": [o["text"] for o in outs],
        }
    finally:
        srv.terminate()
        srv.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slowfast", default="target/release/slowfast", help="the slowfast binary")
    p.add_argument("--model", default="gemma3-270m", help="--model for serve")
    p.add_argument("--served-name", help="the model name requests use (default: --model)")
    p.add_argument("--system-file", required=True, help="text the shared system prompt is cut from")
    p.add_argument("--system-tokens", type=int, default=8192, help="approximate tokens of the system prompt")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-context", type=int, default=9216)
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument for serve (repeatable)")
    p.add_argument("--baseline", metavar="BIN",
                   help="compare this slowfast binary against --slowfast, the cache on in both "
                        "(instead of the cache off against on)")
    p.add_argument("--json", dest="json_out", help="write both runs as JSON here")
    args = p.parse_args()
    words = open(args.system_file, encoding="utf-8", errors="replace").read().split()
    # About 1.3 tokens a word for English prose; trimmed below against the real count.
    system = " ".join(words[: int(args.system_tokens / 1.3)])
    if args.baseline:
        runs = [run(args, system, True, args.baseline), run(args, system, True, args.slowfast)]
    else:
        runs = [run(args, system, False), run(args, system, True)]
    same = runs[0]["texts"] == runs[1]["texts"]
    print(f"{'run':<6} {'TTFT mean':>10} {'p50':>8} {'max':>8} {'wall':>8} {'prefilled':>10} "
          f"{'restored':>9} {'KV peak MB':>11} {'cache MB':>9}")
    for r in runs:
        print(f"{r['label']:<6} {r['ttft_mean_s']:>9.2f}s {r['ttft_p50_s']:>7.2f}s "
              f"{r['ttft_max_s']:>7.2f}s {r['wall_s']:>7.1f}s {r['prefill_tokens']:>10.0f} "
              f"{r['prefix_hit_tokens']:>9.0f} {r['kv_bytes_in_use_peak'] / 1e6:>11.1f} "
              f"{r['prefix_cache_bytes'] / 1e6:>9.1f}")
    print(f"greedy texts identical in both runs: {same}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "identical": same, "runs": runs}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
