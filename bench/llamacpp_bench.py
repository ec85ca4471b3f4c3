#!/usr/bin/env python3
"""Prefill and decode speed of llama.cpp (llama-cpp-python) on the CPU, at several context lengths.

    python3 bench/llamacpp_bench.py --model GGUF --contexts 2048,8192 --new-tokens 64 \
        --threads 2 [--text data/texts/austen_prideprejudice.txt] [--json OUT] [--repeats 1]

For each context C: the prompt is the first C tokens (BOS + real text). Warm-up: one decode of a
short prompt plus a few decode steps (not timed). Then, timed: prefill of the C-token prompt in
batches of --batch tokens with logits for the last token only (tokens/s = C / seconds), followed by
--new-tokens greedy decode steps, one token per llama_decode, each step returning the logits of
its token and taking the argmax in numpy (tokens/s = new / seconds). The KV cache is cleared
between contexts. With --repeats R the best (fastest) of R runs is reported.

The 1-minute load average before and after is recorded: ggml's worker threads busy-wait at
barriers, so with --threads equal to the core count on a machine that is busy with other work,
decode can slow down by 10x or more (measured: 2 threads on 2 shared cores, load ~5: 1.5 tok/s
decode at 2K context, against 34 tok/s with 1 thread at the same time).
"""

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_nll as L  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def prompt_tokens(llm, text_path, n):
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    toks = L.tokenize(llm, text, add_bos=True)
    if len(toks) < n:
        sys.exit(f"{text_path} gives only {len(toks)} tokens; need {n}")
    return toks[:n]


def prefill(llm, toks):
    L.reset(llm)
    last = None
    for start in range(0, len(toks), llm.n_batch):
        chunk = toks[start : start + llm.n_batch]
        want = [False] * len(chunk)
        if start + len(chunk) == len(toks):
            want[-1] = True
        out = L.decode(llm, chunk, start, want)
        if len(out):
            last = out[0]
    return last


def decode_steps(llm, first_logits, n_past, steps):
    row = first_logits
    for i in range(steps):
        nxt = int(np.argmax(row))
        row = L.decode(llm, [nxt], n_past + i, [True])[0]


def run_one(llm, toks, new_tokens):
    t0 = time.perf_counter()
    last = prefill(llm, toks)
    t1 = time.perf_counter()
    decode_steps(llm, last, len(toks), new_tokens)
    t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1}


def main():
    ap = argparse.ArgumentParser(description="llama.cpp CPU prefill/decode benchmark")
    ap.add_argument("--model", required=True)
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--text", default=os.path.join(REPO, "data", "texts", "austen_prideprejudice.txt"))
    ap.add_argument("--json", help="also write the results as JSON to this path")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    import llama_cpp

    llm = L.load(args.model, n_ctx=max(contexts) + args.new_tokens + 8, threads=args.threads,
                 n_batch=args.batch)
    toks = prompt_tokens(llm, args.text, max(contexts))
    # warm-up: small prefill + a few decode steps
    decode_steps(llm, prefill(llm, toks[:64]), 64, 8)

    load_before = os.getloadavg()[0]
    rows = []
    for c in contexts:
        best = None
        for _ in range(args.repeats):
            r = run_one(llm, toks[:c], args.new_tokens)
            if best is None or r["prefill_s"] + r["decode_s"] < best["prefill_s"] + best["decode_s"]:
                best = r
        rows.append(
            {
                "context": c,
                "new_tokens": args.new_tokens,
                "prefill_s": round(best["prefill_s"], 3),
                "prefill_tok_s": round(c / best["prefill_s"], 1),
                "decode_s": round(best["decode_s"], 3),
                "decode_tok_s": round(args.new_tokens / best["decode_s"], 2),
            }
        )
    result = {
        "engine": "llama.cpp via llama-cpp-python",
        "llama_cpp_version": llama_cpp.__version__,
        "model_file": os.path.basename(args.model),
        "threads": args.threads,
        "n_batch": args.batch,
        "repeats": args.repeats,
        "text_file": os.path.basename(args.text),
        "cpu": platform.processor() or platform.machine(),
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "results": rows,
    }
    print(f"llama.cpp {llama_cpp.__version__}  {os.path.basename(args.model)}  threads={args.threads}"
          f"  loadavg {result['loadavg_1m_before']} -> {result['loadavg_1m_after']}")
    print(f"{'context':>8} {'prefill s':>10} {'prefill tok/s':>14} {'new':>5} {'decode s':>9} "
          f"{'decode tok/s':>13}")
    for r in rows:
        print(f"{r['context']:>8} {r['prefill_s']:>10.2f} {r['prefill_tok_s']:>14.1f} "
              f"{r['new_tokens']:>5} {r['decode_s']:>9.2f} {r['decode_tok_s']:>13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
