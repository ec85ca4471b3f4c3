#!/usr/bin/env python3
"""Teacher-forced NLL of a GGUF model on a text, computed with llama.cpp (llama-cpp-python).

    python3 bench/llamacpp_nll.py --model GGUF --input TEXT --context N --eval-tokens E [--threads 2]

Tokenizes TEXT with BOS (llama.cpp's tokenizer, special tokens not parsed), keeps t_0..t_N,
evaluates t_0..t_{N-1} in one pass (batches of --batch tokens, KV cache kept), and prints JSON with
    nll = mean over i in [N-E, N-1] of -log p(t_{i+1} | t_0..t_i)     (natural log)
i.e. exactly the E predictions of E teacher-forced decode steps after a prefill of N-E tokens.
The log-softmax is taken over the full vocabulary in float64 from llama.cpp's float32 logits.

The helpers here (load, decode, scored_positions) are also used by
scripts/fixtures/make_llamacpp_fixtures.py and bench/llamacpp_bench.py.
"""

import argparse
import ctypes
import hashlib
import json
import os
import sys
import time

import numpy as np

import llama_cpp


def load(model_path, n_ctx, threads=2, n_batch=512, kv_f32=False):
    """Opens a GGUF with llama.cpp on the CPU; flash attention off, f16 KV cache (defaults),
    or an f32 KV cache with kv_f32."""
    if not os.path.isfile(model_path):
        sys.exit(f"model file not found: {model_path}")
    kv = {"type_k": 0, "type_v": 0} if kv_f32 else {}  # 0 = GGML_TYPE_F32
    return llama_cpp.Llama(
        model_path=model_path,
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_batch,
        n_threads=threads,
        n_threads_batch=threads,
        n_gpu_layers=0,
        logits_all=False,
        verbose=False,
        **kv,
    )


def tokenize(llm, text, add_bos=True):
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)


def decode(llm, tokens, n_past, want_logits):
    """Runs one llama_decode over `tokens` at positions n_past.. (len <= n_batch).

    want_logits: list of bools, one per token. Returns float32 [sum(want_logits), n_vocab].
    """
    n = len(tokens)
    if n == 0 or n > llm.n_batch:
        raise ValueError(f"decode got {n} tokens; must be 1..{llm.n_batch}")
    b = llm._batch.batch
    b.n_tokens = n
    for i, t in enumerate(tokens):
        b.token[i] = t
        b.pos[i] = n_past + i
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = 0
        b.logits[i] = bool(want_logits[i])
    rc = llama_cpp.llama_decode(llm.ctx, b)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc} at n_past={n_past}")
    n_vocab = llm.n_vocab()
    rows = []
    for i in range(n):
        if want_logits[i]:
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, i)
            arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_vocab,))
            rows.append(arr.copy())
    return np.stack(rows) if rows else np.zeros((0, n_vocab), np.float32)


def reset(llm):
    """Clears the KV cache so the next decode starts at position 0."""
    llm._ctx.kv_cache_clear()
    llm.n_tokens = 0


def scored_positions(llm, tokens, first):
    """Evaluates tokens[0..len-1] from position 0 and yields (i, logits_i) for i >= first,
    where logits_i (float32 [n_vocab]) predicts tokens[i+1]."""
    reset(llm)
    step = llm.n_batch
    for start in range(0, len(tokens), step):
        chunk = tokens[start : start + step]
        want = [start + j >= first for j in range(len(chunk))]
        logits = decode(llm, chunk, start, want)
        k = 0
        for j in range(len(chunk)):
            if want[j]:
                yield start + j, logits[k]
                k += 1


def log_softmax64(row):
    """Natural-log softmax in float64 over the full vocabulary."""
    x = row.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def nll(model_path, text_path, n, e, threads=2, n_batch=512):
    if not 0 < e <= n:
        raise ValueError(f"--eval-tokens {e} must be in 1..--context {n}")
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    llm = load(model_path, n_ctx=n + 16, threads=threads, n_batch=n_batch)
    toks = tokenize(llm, text, add_bos=True)
    if len(toks) < n + 1:
        raise ValueError(f"{text_path} gives {len(toks)} tokens; need N+1 = {n + 1}")
    toks = toks[: n + 1]  # t_0..t_N
    t0 = time.time()
    losses = []
    for i, row in scored_positions(llm, toks[:n], first=n - e):
        losses.append(-log_softmax64(row)[toks[i + 1]])
    secs = time.time() - t0
    losses = np.array(losses)
    return {
        "text_file": os.path.basename(text_path),
        "text_sha256": sha256_file(text_path),
        "model_file": os.path.basename(model_path),
        "N": n,
        "E": e,
        "nll": float(losses.mean()),
        "ppl": float(np.exp(losses.mean())),
        "nll_first_half": float(losses[: e // 2].mean()),
        "nll_second_half": float(losses[e // 2 :].mean()),
        "add_bos": True,
        "n_batch": n_batch,
        "threads": threads,
        "seconds": round(secs, 2),
        "llama_cpp_version": llama_cpp.__version__,
    }


def main():
    ap = argparse.ArgumentParser(description="llama.cpp teacher-forced NLL on a text")
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True, help="UTF-8 text file")
    ap.add_argument("--context", type=int, required=True, help="N: tokens t_0..t_{N-1} evaluated")
    ap.add_argument("--eval-tokens", type=int, required=True, help="E: predictions scored")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    args = ap.parse_args()
    out = nll(args.model, args.input, args.context, args.eval_tokens, args.threads, args.batch)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
