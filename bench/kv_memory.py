#!/usr/bin/env python3
"""KV-memory benchmark for `slowfast serve`: on-demand KV with preemption against reserving it.

Starts the server twice on the same model, flags and --kv-memory: once with --kv-reserve (each
request's whole KV, prompt + max_tokens, reserved at admission; nothing is ever preempted) and
once as by default (a sequence holds what its tokens need so far; the newest is preempted and
later recomputed when the running ones outgrow the memory). It sends the same N requests at
once (streaming /v1/completions, greedy, ignore_eos), whose max_tokens cycle through
--max-tokens (a mix of short and long answers), and reports per run: the wall time of the burst,
generated tokens per second, the mean decode batch (rows / steps), the peak of running
sequences and of KV bytes in use, preemptions, prompt tokens prefilled (recomputation included)
and the time to first token (mean, max). Texts are compared between the runs: a resumed
sequence's KV is recomputed by prefill, whose rounding may differ from decoding, so a greedy
text may part after a preemption at a near-tie; the count of identical texts is reported.

  python3 bench/kv_memory.py --slowfast target/release/slowfast --model smollm2-135m \\
      --text data/texts/austen_emma.txt --requests 24 --prompt-tokens 200 \\
      --max-tokens 64,128,256,512,768 --max-context 1024 --max-batch 16 --kv-memory 94371840
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
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=7200)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        out["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
        return
    text = []
    n = 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for ch in chunk.get("choices", []):
            if ch.get("text") is not None and ch.get("finish_reason") is None:
                out.setdefault("ttft", time.perf_counter() - t0)
                n += 1
            text.append(ch.get("text") or "")
    out["text"] = "".join(text)
    out["chunks"] = n
    out["end"] = time.perf_counter() - t0


def run(args, prompts: list[str], budgets: list[int], reserve: bool) -> dict:
    port = free_port()
    cmd = [args.slowfast, "serve", "--model", args.model, "--port", str(port),
           "--max-batch", str(args.max_batch), "--max-context", str(args.max_context),
           "--max-queue", str(len(prompts) + 8), "--kv-memory", str(args.kv_memory),
           "--prefix-cache-memory", "0"]
    if reserve:
        cmd.append("--kv-reserve")
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
        outs = [dict() for _ in prompts]
        peak = {"kv": 0.0, "running": 0.0}
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                try:
                    m = metrics(port)
                    peak["kv"] = max(peak["kv"], m.get("slowfast_kv_bytes_in_use", 0))
                    peak["running"] = max(peak["running"], m.get("slowfast_running_sequences", 0))
                except OSError:
                    pass
                stop.wait(0.2)

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        t0 = time.perf_counter()
        ts = [threading.Thread(target=one, args=(port, model, p, n, t0, o))
              for p, n, o in zip(prompts, budgets, outs)]
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
        d = lambda k: after.get(k, 0) - before.get(k, 0)
        generated = d("slowfast_generation_tokens_total")
        ttft = [o["ttft"] for o in outs]
        return {
            "kv_reserve": reserve,
            "requests": len(prompts),
            "wall_s": wall,
            "generated_tokens": generated,
            "tokens_per_s": generated / wall,
            "mean_batch": d("slowfast_decode_rows_total") / max(1.0, d("slowfast_decode_steps_total")),
            "running_peak": peak["running"],
            "kv_bytes_in_use_peak": peak["kv"],
            "preemptions": d("slowfast_preemptions_total"),
            "prefill_tokens": d("slowfast_prefill_tokens_total"),
            "ttft_mean_s": statistics.mean(ttft),
            "ttft_max_s": max(ttft),
            "texts": [o["text"] for o in outs],
        }
    finally:
        srv.terminate()
        srv.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slowfast", default="target/release/slowfast", help="the slowfast binary")
    p.add_argument("--model", default="smollm2-135m", help="--model for serve")
    p.add_argument("--served-name", help="the model name requests use (default: --model)")
    p.add_argument("--text", required=True, help="text the prompts are cut from")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=200, help="approximate tokens a prompt")
    p.add_argument("--max-tokens", default="64,128,256,512,768",
                   help="max_tokens of the requests, cycled through (comma-separated)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--kv-memory", type=int, required=True, help="--kv-memory for both runs (bytes)")
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument for serve (repeatable)")
    p.add_argument("--json", dest="json_out", help="write both runs as JSON here")
    args = p.parse_args()
    words = open(args.text, encoding="utf-8", errors="replace").read().split()
    per = int(args.prompt_tokens / 1.3)  # about 1.3 tokens a word for English prose
    prompts = [" ".join(words[i * per:(i + 1) * per]) for i in range(args.requests)]
    sizes = [int(x) for x in args.max_tokens.split(",")]
    budgets = [sizes[i % len(sizes)] for i in range(args.requests)]
    runs = [run(args, prompts, budgets, True), run(args, prompts, budgets, False)]
    same = sum(a == b for a, b in zip(runs[0]["texts"], runs[1]["texts"]))
    print(f"{'KV':<10} {'wall':>8} {'tok/s':>7} {'batch':>6} {'running':>8} {'KV peak MB':>11} "
          f"{'preempt':>8} {'prefilled':>10} {'TTFT mean':>10} {'max':>8}")
    for r in runs:
        print(f"{'reserved' if r['kv_reserve'] else 'on demand':<10} {r['wall_s']:>7.1f}s "
              f"{r['tokens_per_s']:>7.1f} {r['mean_batch']:>6.2f} {r['running_peak']:>8.0f} "
              f"{r['kv_bytes_in_use_peak'] / 1e6:>11.1f} {r['preemptions']:>8.0f} "
              f"{r['prefill_tokens']:>10.0f} {r['ttft_mean_s']:>9.2f}s {r['ttft_max_s']:>7.2f}s")
    print(f"greedy texts identical between the runs: {same} of {len(prompts)}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "identical": same, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
