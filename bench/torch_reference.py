#!/usr/bin/env python3
"""PyTorch reference for `slowfast bench --device cuda`: the same architecture (Qwen3-4B shapes
by default, random weights) built through HF transformers in bf16 on the GPU, prefilled with
random tokens and decoded greedily with a static KV cache and SDPA attention, at the same
contexts. Prints prefill tok/s and decode tok/s / ms per step per context (and --json).

    python3 bench/torch_reference.py --contexts 8k,32k,128k --new-tokens 64 [--json out.json]

Timings use CUDA events around the whole step (model forward + argmax), eager mode (no
torch.compile unless --compile, which adds minutes of compile time per shape).
"""
import argparse
import json
import sys
import time

import torch

DEV = "cuda"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()

PRESETS = {
    # hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied
    "tiny": (64, 2, 4, 2, 16, 128, 512, True),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
}


def parse_contexts(s):
    out = []
    for t in s.split(","):
        t = t.strip().lower()
        out.append(int(t[:-1]) * 1024 if t.endswith("k") else int(t))
    return out


def build(preset, max_pos):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    h, layers, heads, kv, hd, inter, vocab, tied = PRESETS[preset]
    cfg = Qwen3Config(
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=max_pos,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEV):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(prev)
    model.eval()
    return cfg, model


def static_cache(cfg, model, max_len):
    from transformers import StaticCache

    try:
        return StaticCache(config=cfg, max_cache_len=max_len)
    except TypeError:
        return StaticCache(
            config=cfg, max_batch_size=1, max_cache_len=max_len, device="cuda", dtype=torch.bfloat16
        )


@torch.inference_mode()
def run_one(cfg, model, ctx, new_tokens, chunk, step_fn):
    g = torch.Generator(device="cpu").manual_seed(ctx)
    prompt = torch.randint(0, cfg.vocab_size, (1, ctx), generator=g).to(DEV)
    cache = static_cache(cfg, model, ctx + new_tokens + 1)
    sync()
    t0 = time.perf_counter()
    logits = None
    for s in range(0, ctx, chunk):
        ids = prompt[:, s : s + chunk]
        pos = torch.arange(s, s + ids.shape[1], device=DEV)
        out = model(
            input_ids=ids,
            past_key_values=cache,
            cache_position=pos,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits
    sync()
    prefill_s = time.perf_counter() - t0
    tok = logits[:, -1].argmax(-1, keepdim=True)
    pos = torch.tensor([ctx], device=DEV)
    # one warm-up step
    tok = step_fn(tok, cache, pos)
    pos += 1
    sync()
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        tok = step_fn(tok, cache, pos)
        pos += 1
    sync()
    ms = (time.perf_counter() - t1) * 1e3 / max(new_tokens - 1, 1)
    del cache
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return prefill_s, ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-4b", choices=sorted(PRESETS))
    ap.add_argument("--contexts", default="8k,32k")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192, help="prefill tokens per forward pass")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cuda (the reference) or cpu (a smoke test)")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    import transformers

    contexts = parse_contexts(a.contexts)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.cuda.get_device_name(0) if DEV == 'cuda' else 'cpu'}; {a.preset} random bf16 weights, SDPA, static cache",
        flush=True,
    )
    cfg, model = build(a.preset, max(contexts) + a.new_tokens + 8)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"weights {wbytes / 2**30:.2f} GiB", flush=True)

    def step(tok, cache, pos):
        out = model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    step_fn = torch.compile(step, mode="reduce-overhead") if a.compile else step
    # warm-up (cuBLAS / SDPA kernel selection) outside the timed contexts
    run_one(cfg, model, min(1024, min(contexts)), 4, a.chunk, step_fn)
    recs = []
    print("| context | prefill tok/s | decode tok/s | ms/step | peak GiB |")
    print("|---|---|---|---|---|", flush=True)
    for ctx in contexts:
        if DEV == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            prefill_s, ms = run_one(cfg, model, ctx, a.new_tokens, a.chunk, step_fn)
        except Exception as e:  # report and go on with the next context
            import traceback

            traceback.print_exc()
            print(f"| {ctx} | failed: {type(e).__name__}: {str(e)[:200]} |", flush=True)
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0
        r = {
            "framework": "pytorch (transformers, SDPA, static cache, eager)",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "preset": a.preset,
            "context": ctx,
            "new_tokens": a.new_tokens,
            "prefill_tok_s": ctx / prefill_s,
            "decode_tok_s": 1000.0 / ms,
            "decode_ms_per_step": ms,
            "peak_gpu_mem_gib": peak,
            "compiled": a.compile,
        }
        recs.append(r)
        print(
            f"| {ctx} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {ms:.3f} | {peak:.1f} |",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
