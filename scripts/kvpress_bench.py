#!/usr/bin/env python3
"""Decode-throughput baseline: NVIDIA kvpress on HF transformers, Qwen3-4B shape, random weights.

What it measures
    For each KV-cache method it builds one random prompt of --context tokens, prefills it
    through the model with the matching kvpress "press" active (so the cache is compressed
    during prefill, the way kvpress's KVPressTextGenerationPipeline does it: the press's
    context manager around a forward of the decoder stack, no LM head, into a DynamicCache),
    then runs greedy decoding WITHOUT the press, one token per forward, with logical
    position ids continuing after the uncompressed context (again as kvpress's pipeline
    does). After --warmup untimed steps it times --new-tokens decode steps (device
    synchronised before and after) and reports, per method:
      method, press class, compression_ratio, context, batch, prefill seconds, decode tok/s
      (batch * steps / seconds), ms per step, KV tokens per layer after prefill (read from
      the cache's key tensors), KV cache GiB, and peak GPU memory (CUDA only).
    Every step copies the new token ids to the host (kvpress's pipeline reads each token to
    test for EOS; a server must read it to stream it); --no-step-sync turns that off.
    Decoding always runs the fixed number of steps (no EOS stop: the weights are random).

    The model is Qwen3ForCausalLM with Qwen3-4B's architecture (36 layers, hidden 2560,
    32 query / 8 KV heads of dim 128, MLP 9728, vocab 151936, tied embeddings, rope theta
    1e6), bf16, random weights (normal(0, 0.02) via transformers' own init, created
    directly on --device). Nothing is downloaded. --tiny swaps in a 2-layer toy of the
    same family for CPU smoke tests.

Methods (engine policy name -> kvpress press)
    full       no press (the whole prompt stays in the cache)
    streaming  StreamingLLMPress (n_sink = --sinks, default 4 like the engine)
    snapkv     SnapKVPress (window/kernel = --window/--kernel, default 32/7 like the engine)
    pyramidkv  PyramidKVPress (same window/kernel, beta = --pyramid-beta, default 20)
    h2o        ObservedAttentionPress (kvpress's H2O-style press). It scores with the
               attention matrix that only eager attention returns, so its prefill runs
               with attn_implementation="eager" (decode then goes back to
               --attn-implementation). Eager prefill materialises batch*heads*L*L
               attention weights per layer (~258 GiB at L=32768 for this model), so the
               method is skipped with a message when that cannot fit; run it separately
               at a shorter context, e.g. --context 8192 --methods h2o.
    knorm      KnormPress (extra: not an engine policy, not in the default list)
    kvpress has no Quest press, so there is no "quest" here.
    --budget F is the fraction of the context kept (F < 1) or, like the engine's
    --kv-budget, a token count (F >= 1); compression_ratio = 1 - kept / context.

cuDNN attention is switched off (CUDA only; --allow-cudnn-sdpa keeps it)
    PyTorch's SDPA may dispatch to its cuDNN backend, which builds an execution plan for
    every new key length it meets. In a decode loop every step has a new length, and
    under PyramidKV every layer too, so measured on an H200 with torch 2.11 the cuDNN
    path spent ~40-60 ms per new shape: ~1.4 s per step for pyramidkv and 2-3x slower
    steps for whichever uniform-length method ran first (later ones reused its plans).
    That measures plan building, not attention, so the script disables that backend and
    SDPA uses its flash / memory-efficient kernels instead.

Compatibility shims (applied at run time, kvpress itself is not modified)
  * kvpress 0.5.5 pins transformers<5.3; since then transformers no longer passes
    `cache_position` to attention modules, and kvpress's forward hooks read it to tell
    prefill from decode. The script gives each press a hook wrapper that supplies it
    (arange(len_before, len_after) of that layer's cache), which is what older
    transformers passed.
  * `import kvpress` imports `datasets` and `fire` at module level for two presses that
    this benchmark does not use (DuoAttentionPress, ExpectedAttentionStatsPress). When
    they are not installed, throw-away stand-ins are put in sys.modules for the import only.

How to run
    Remote GPU (kvpress wheels in .whl/, torch/transformers already installed):
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
        python3 scripts/kvpress_bench.py --json kvpress_bench.json
        python3 scripts/kvpress_bench.py --context 8192 --methods full,h2o --json kvpress_h2o_8k.json
    CPU smoke test:
        OMP_NUM_THREADS=1 python3 scripts/kvpress_bench.py --tiny --device cpu \
            --context 512 --new-tokens 8 --methods full,streaming,snapkv,pyramidkv,h2o,knorm

The markdown table goes to stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import importlib.machinery
import json
import math
import os
import platform
import sys
import time
import types

T0 = time.time()


def log(msg: str) -> None:
    print(f"[kvpress_bench {time.time() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------

# engine policy name -> (kvpress class name or None, needs eager prefill, in default list)
METHODS = {
    "full": (None, False, True),
    "streaming": ("StreamingLLMPress", False, True),
    "snapkv": ("SnapKVPress", False, True),
    "pyramidkv": ("PyramidKVPress", False, True),
    "h2o": ("ObservedAttentionPress", True, True),
    "knorm": ("KnormPress", False, False),
}
DEFAULT_METHODS = ",".join(m for m, (_, _, d) in METHODS.items() if d)
NOT_IN_KVPRESS = {
    "quest": "kvpress has no Quest press (Quest selects pages per query at decode time; "
    "kvpress's presses evict at prefill)",
}

QWEN3_4B = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    bos_token_id=151643,
    eos_token_id=151645,
)
TINY = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def parse_methods(text: str) -> list[str]:
    names = [m.strip().lower() for m in text.split(",") if m.strip()]
    if not names:
        raise SystemExit(f"--methods is empty; valid methods: {', '.join(METHODS)}")
    bad = [m for m in names if m not in METHODS]
    if bad:
        lines = [f"unknown method(s) in --methods: {', '.join(bad)}"]
        for m in bad:
            if m in NOT_IN_KVPRESS:
                lines.append(f"  {m}: {NOT_IN_KVPRESS[m]}")
        lines.append(f"valid methods: {', '.join(METHODS)} (default: {DEFAULT_METHODS})")
        raise SystemExit("\n".join(lines))
    seen = []
    for m in names:
        if m not in seen:
            seen.append(m)
    return seen


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="kvpress decode-throughput benchmark on a random-weight Qwen3-4B-shaped model",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default="cuda", help="torch device (cuda, cuda:1, cpu)")
    p.add_argument("--tiny", action="store_true", help="2-layer toy config of the same family (CPU tests)")
    p.add_argument("--context", type=int, default=32768, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="timed greedy decode steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps before the timed ones")
    p.add_argument(
        "--budget",
        type=float,
        default=0.2,
        help="KV kept: fraction of --context if < 1, else a token count; compression_ratio = 1 - kept/context",
    )
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list from: {', '.join(METHODS)}")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (same length, no padding)")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attn-implementation",
        default="sdpa",
        help="transformers attention backend for prefill and decode (h2o prefill is always eager)",
    )
    p.add_argument("--sinks", type=int, default=4, help="StreamingLLM sink tokens (engine default 4)")
    p.add_argument("--window", type=int, default=32, help="SnapKV/PyramidKV observation window (engine: 32)")
    p.add_argument("--kernel", type=int, default=7, help="SnapKV/PyramidKV pooling kernel (engine: 7)")
    p.add_argument("--pyramid-beta", type=int, default=20, help="PyramidKV beta (engine: 20)")
    p.add_argument(
        "--no-step-sync",
        action="store_true",
        help="do not copy each new token to the host (kvpress's pipeline does, to test for EOS)",
    )
    p.add_argument(
        "--allow-cudnn-sdpa",
        action="store_true",
        help="keep PyTorch's cuDNN SDPA backend (it re-plans per new KV length; see the docstring)",
    )
    p.add_argument(
        "--h2o-mem-factor",
        type=float,
        default=0.9,
        help="skip h2o when its estimated eager-attention memory exceeds this fraction of free GPU memory",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 with --tiny)")
    args = p.parse_args(argv)
    args.methods = parse_methods(args.methods)
    if args.context < 2:
        p.error("--context must be at least 2")
    if args.new_tokens < 1 or args.warmup < 0 or args.batch < 1:
        p.error("--new-tokens and --batch must be >= 1, --warmup >= 0")
    if not (args.budget > 0 and math.isfinite(args.budget)):
        p.error("--budget must be a positive fraction (< 1) or token count (>= 1)")
    return args


def kept_tokens(budget: float, context: int) -> int:
    # Same rule as the engine's budget_tokens().
    return max(1, round(budget * context)) if budget < 1 else int(budget)


# --------------------------------------------------------------------------------------
# kvpress import and compatibility
# --------------------------------------------------------------------------------------


def import_kvpress():
    """Import kvpress, standing in for optional modules it imports but we never use."""
    stubs = []
    for name, attr in (("datasets", "load_dataset"), ("fire", "Fire")):
        try:
            importlib.import_module(name)
        except ImportError:
            mod = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)

            def _absent(*_a, _name=name, **_k):
                raise ImportError(f"'{_name}' is not installed (kvpress_bench stood in for it at import)")

            setattr(mod, attr, _absent)
            sys.modules[name] = mod
            stubs.append(name)
    try:
        import kvpress  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"cannot import kvpress: {e}\n"
            "install the wheels first: python3 -m pip install -q --no-index --no-deps --no-compile "
            "--no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site"
        ) from e
    finally:
        # Only kvpress's modules needed the names; keep them out of everyone else's way.
        for name in stubs:
            sys.modules.pop(name, None)
    if stubs:
        log(f"'{', '.join(stubs)}' not installed: stood in for them while importing kvpress (unused here)")
    return kvpress


_SHIM_NOTED = False


def with_cache_position(press):
    """Make a press's forward hook work with transformers that no longer pass cache_position.

    kvpress <= 0.5.5 decides "prefill or not" from kwargs["cache_position"] in the hook on each
    attention module. When the kwarg is missing, supply the cache slots this forward wrote for
    that layer: arange(len_before, len_after), len_after being read after the cache update.
    """
    import torch

    inner = press.forward_hook

    def hook(module, args, kwargs, output):
        global _SHIM_NOTED
        if kwargs.get("cache_position") is None:
            hidden = kwargs["hidden_states"]
            cache = kwargs["past_key_values"]
            end = cache.layers[module.layer_idx].get_seq_length()
            kwargs = dict(kwargs)
            kwargs["cache_position"] = torch.arange(end - hidden.shape[1], end, device=hidden.device)
            if not _SHIM_NOTED:
                _SHIM_NOTED = True
                log("transformers did not pass cache_position to attention; supplying it for kvpress's hooks")
        return inner(module, args, kwargs, output)

    press.forward_hook = hook
    return press


def make_press(kvpress, method: str, ratio: float, args):
    cls_name = METHODS[method][0]
    if cls_name is None:
        return None
    cls = getattr(kvpress, cls_name, None)
    if cls is None:
        raise SystemExit(f"this kvpress ({getattr(kvpress, '__version__', '?')}) has no {cls_name} for '{method}'")
    kw = {"compression_ratio": ratio}
    if method == "streaming":
        kw["n_sink"] = args.sinks
    elif method in ("snapkv", "pyramidkv"):
        kw.update(window_size=args.window, kernel_size=args.kernel)
        if method == "pyramidkv":
            kw["beta"] = args.pyramid_beta
    return with_cache_position(cls(**kw))


def press_params(press) -> dict:
    if press is None:
        return {}
    out = {}
    for f in dataclasses.fields(press):
        v = getattr(press, f.name)
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[f.name] = v
    return out


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


def build_model(args, torch):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    arch = dict(TINY if args.tiny else QWEN3_4B)
    theta = arch.pop("rope_theta")
    cfg = Qwen3Config(**arch, rope_parameters={"rope_type": "default", "rope_theta": theta})
    t = time.time()
    # Built directly on the device in bf16; transformers' init draws normal(0, 0.02).
    with torch.device(args.device):
        model = Qwen3ForCausalLM._from_config(
            cfg, dtype=torch.bfloat16, attn_implementation=args.attn_implementation
        )
    model.eval()
    model.requires_grad_(False)
    n = sum(p.numel() for p in model.parameters())
    log(
        f"built Qwen3ForCausalLM ({'tiny' if args.tiny else 'Qwen3-4B shape'}): {n / 1e9:.3f} B params, "
        f"bf16 on {args.device}, attn={model.config._attn_implementation}, {time.time() - t:.1f}s"
    )
    return model


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_stats(cache):
    lens, nbytes = [], 0
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        lens.append(int(k.shape[-2]))
        nbytes += k.numel() * k.element_size() + v.numel() * v.element_size()
    return lens, nbytes


@contextlib.contextmanager
def attn_impl(model, impl):
    old = model.config._attn_implementation
    if impl == old:
        yield
        return
    model.set_attn_implementation(impl)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


def prefill(torch, model, press, ids, cache):
    """kvpress-style prefill: press hooks active, decoder stack only, then the LM head on the last row."""
    ctx = press(model) if press is not None else contextlib.nullcontext()
    with ctx:
        out = model.model(input_ids=ids, past_key_values=cache, use_cache=True)
    last = out.last_hidden_state[:, -1:, :]
    del out
    return model.lm_head(last).argmax(dim=-1)  # (batch, 1)


def eager_bytes(args, cfg) -> int:
    # Per layer during the eager prefill: scores (bf16) + softmax (fp32) + cast (bf16) of
    # batch x heads x L x L, plus the additive L x L mask.
    L = args.context
    return 8 * args.batch * cfg.num_attention_heads * L * L + 2 * args.batch * L * L


# --------------------------------------------------------------------------------------
# One method
# --------------------------------------------------------------------------------------


def run_method(torch, kvpress, model, method, args, device):
    from transformers import DynamicCache

    cfg = model.config
    kept = min(kept_tokens(args.budget, args.context), args.context)
    # kvpress keeps int(L * (1 - ratio)) tokens; the 1e-6 keeps float rounding from dropping one.
    ratio = 0.0 if method == "full" else max(0.0, 1.0 - (kept + 1e-6) / args.context)
    press = make_press(kvpress, method, ratio, args)
    cls_name = type(press).__name__ if press is not None else None
    needs_eager = METHODS[method][1]
    res = {
        "method": method,
        "press": cls_name,
        "press_params": press_params(press),
        "compression_ratio": round(ratio, 6),
        "target_kept_tokens": args.context if method == "full" else kept,
        "context": args.context,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "warmup_steps": args.warmup,
        "prefill_attn": "eager" if needs_eager else cfg._attn_implementation,
        "decode_attn": cfg._attn_implementation,
        "status": "ok",
    }

    if needs_eager and device.type == "cuda":
        need = eager_bytes(args, cfg)
        free, _total = torch.cuda.mem_get_info(device)
        if need > args.h2o_mem_factor * free:
            msg = (
                f"{method} ({cls_name}) needs eager attention in prefill, which materialises "
                f"batch*heads*L*L attention weights: ~{need / 2**30:.0f} GiB per layer at "
                f"--context {args.context}, but only {free / 2**30:.0f} GiB is free; skipped. "
                f"Run it on its own at a shorter context, e.g. --context 8192 --methods full,{method}"
            )
            log(msg)
            res.update(status="skipped", note=msg)
            return res

    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.context), generator=gen).to(device)
    cache = DynamicCache()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    log(f"{method}: prefill {args.batch}x{args.context} tokens, press={cls_name}, ratio={ratio:.4f}")
    sync(torch, device)
    t = time.perf_counter()
    with attn_impl(model, "eager") if needs_eager else contextlib.nullcontext():
        tok = prefill(torch, model, press, ids, cache)
    sync(torch, device)
    res["prefill_s"] = time.perf_counter() - t
    res["prefill_tok_s"] = args.batch * args.context / res["prefill_s"]
    lens, nbytes = kv_stats(cache)
    res["kv_tokens_per_layer"] = lens
    res["kv_tokens_mean"] = sum(lens) / len(lens)
    res["kv_tokens_min"] = min(lens)
    res["kv_tokens_max"] = max(lens)
    res["kv_cache_gib"] = nbytes / 2**30
    log(
        f"{method}: prefill {res['prefill_s']:.2f}s; KV tokens/layer mean {res['kv_tokens_mean']:.1f} "
        f"(min {min(lens)}, max {max(lens)}), {res['kv_cache_gib']:.3f} GiB"
    )

    # Greedy decode without the press; positions continue after the full (uncompressed) context.
    pos = torch.full((args.batch, 1), args.context, dtype=torch.long, device=device)
    step_sync = not args.no_step_sync
    produced = [tok.cpu()] if step_sync else [tok]

    def step(tok, pos):
        out = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        produced.append(nxt.cpu() if step_sync else nxt)
        return nxt

    for _ in range(args.warmup):
        tok = step(tok, pos)
        pos = pos + 1
    sync(torch, device)
    log(f"{method}: timing {args.new_tokens} decode steps")
    t = time.perf_counter()
    for _ in range(args.new_tokens):
        tok = step(tok, pos)
        pos = pos + 1
    sync(torch, device)
    dt = time.perf_counter() - t
    res["decode_s"] = dt
    res["decode_tok_s"] = args.batch * args.new_tokens / dt
    res["ms_per_step"] = 1000.0 * dt / args.new_tokens
    res["kv_tokens_after_decode_mean"] = sum(kv_stats(cache)[0]) / len(cache.layers)
    res["first_tokens"] = torch.cat([p.cpu() for p in produced[:8]], dim=1)[0].tolist()
    if device.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        res["peak_mem_gib"] = None
    log(f"{method}: {res['decode_tok_s']:.1f} tok/s, {res['ms_per_step']:.2f} ms/step")

    del cache, ids, tok, pos, produced
    return res


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------

COLUMNS = [
    ("method", "method"),
    ("press", "press"),
    ("ratio", "compression_ratio"),
    ("context", "context"),
    ("batch", "batch"),
    ("prefill s", "prefill_s"),
    ("decode tok/s", "decode_tok_s"),
    ("ms/step", "ms_per_step"),
    ("KV tok/layer (min-max)", None),
    ("KV GiB", "kv_cache_gib"),
    ("peak GiB", "peak_mem_gib"),
]


def table_header() -> str:
    names = [c for c, _ in COLUMNS]
    return "| " + " | ".join(names) + " |\n|" + "|".join("---" for _ in names) + "|"


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:.1f}"
        if abs(v) >= 1:
            return f"{v:.3f}".rstrip("0").rstrip(".") if v != int(v) else f"{v:.1f}"
        return f"{v:.4f}"
    return str(v)


def table_row(r: dict) -> str:
    cells = []
    for name, key in COLUMNS:
        if key is None:
            if r.get("status") != "ok":
                cells.append(r.get("status", "?"))
            else:
                cells.append(f"{r['kv_tokens_mean']:.1f} ({r['kv_tokens_min']}-{r['kv_tokens_max']})")
        elif r.get("status") != "ok" and key not in ("method", "press", "compression_ratio", "context", "batch"):
            cells.append("-")
        else:
            cells.append(fmt(r.get(key)))
    return "| " + " | ".join(cells) + " |"


def environment(torch, kvpress, args, device) -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvpress": getattr(kvpress, "__version__", None),
        "device": str(device),
    }
    if env["kvpress"] is None:
        try:
            from importlib.metadata import version

            env["kvpress"] = version("kvpress")
        except Exception:
            pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["sdpa_backends"] = {
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        }
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tiny and args.threads is None:
        args.threads = 1
    if args.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device (use --device cpu for a CPU run)")

    if device.type == "cuda" and not args.allow_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
        log("cuDNN SDPA backend disabled (it re-plans for every new KV length; --allow-cudnn-sdpa keeps it)")

    kvpress = import_kvpress()
    env = environment(torch, kvpress, args, device)
    log("versions: " + ", ".join(f"{k} {v}" for k, v in env.items()))

    torch.manual_seed(args.seed)
    model = build_model(args, torch)
    if args.context + args.warmup + args.new_tokens > model.config.max_position_embeddings:
        log("warning: context + decode steps exceed max_position_embeddings")

    # Warm-up (kernels, allocator, lazy init) so the first method's timings are not inflated.
    with torch.inference_mode():
        from transformers import DynamicCache

        n = min(args.context, 256)
        ids = torch.randint(0, model.config.vocab_size, (args.batch, n)).to(device)
        c = DynamicCache()
        tok = prefill(torch, model, None, ids, c)
        for i in range(3):
            p = torch.full((args.batch, 1), n + i, dtype=torch.long, device=device)
            tok = model(input_ids=tok, past_key_values=c, position_ids=p, logits_to_keep=1).logits.argmax(-1)
        sync(torch, device)
        del c, ids, tok
    log("warm-up done")

    results = []
    print(table_header(), flush=True)
    for method in args.methods:
        try:
            with torch.inference_mode():
                r = run_method(torch, kvpress, model, method, args, device)
        except torch.OutOfMemoryError as e:
            msg = f"{method}: out of GPU memory ({str(e).splitlines()[0]})"
            log(msg)
            r = {"method": method, "press": METHODS[method][0], "context": args.context, "batch": args.batch,
                 "status": "oom", "note": msg}
        results.append(r)
        print(table_row(r), flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    doc = {
        "benchmark": "kvpress_decode",
        "model": "Qwen3ForCausalLM, " + ("tiny config" if args.tiny else "Qwen3-4B architecture") + ", random bf16",
        "config": {k: (v.item() if hasattr(v, "item") else v) for k, v in (TINY if args.tiny else QWEN3_4B).items()},
        "args": {k: v for k, v in vars(args).items()},
        "env": env,
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        log(f"wrote {args.json}")
    return 0 if all(r.get("status") in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
