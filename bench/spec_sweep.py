#!/usr/bin/env python3
"""Speculative decoding on real text, CPU: acceptance, tokens per verification and wall-clock
speedup over full KV, each drafter and gamma side by side in one run.

For every text and context it writes a prompt (the text's first ~CONTEXT tokens, or a passkey
prompt: a key hidden at mid-depth in the text with a question at the end), runs
`slowfast generate --json` greedily with full KV, then with each `--speculate` drafter and
`--spec-tokens` value, checks that every speculative run printed full KV's tokens, and prints
a markdown table (and writes the records as JSON with --json).

  python3 bench/spec_sweep.py --texts data/texts/austen_emma.txt --contexts 4096,8192 \
      --drafters sfi,streaming,ngram --gammas 2,4,6,8,adaptive --tokens 128 --passkey

Speedup = full KV's decode seconds / the run's decode seconds (prefill excluded; both runs
decode the same tokens). Timings share the machine with whatever else runs on it.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

CHARS_PER_TOKEN = 4.2  # English prose under Gemma 3's tokenizer, roughly


def run(binary, model, prompt_file, extra, tokens, threads):
    cmd = [binary, "generate", "-m", model, "-f", prompt_file, "-n", str(tokens),
           "--temperature", "0", "--ignore-eos", "--json", *extra]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stderr}")
    return json.loads(out.stdout)


def prompts(texts, contexts, passkey, seed):
    rng = random.Random(seed)
    for path in texts:
        text = open(path, encoding="utf-8").read()
        name = os.path.basename(path).rsplit(".", 1)[0]
        for ctx in contexts:
            n = int(ctx * CHARS_PER_TOKEN)
            start = len(text) // 7  # skip front matter
            body = text[start:start + n]
            yield f"{name}", ctx, body
            if passkey:
                key = rng.randrange(10000, 99999)
                cut = int(ctx * 0.9 * CHARS_PER_TOKEN)
                hay = text[start:start + cut]
                mid = hay.find(". ", len(hay) // 2) + 2
                needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
                q = "\n\nWhat is the pass key? The pass key is"
                yield f"passkey({name})", ctx, hay[:mid] + needle + hay[mid:] + q


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/slowfast")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--texts", required=True, help="comma-separated UTF-8 text files")
    ap.add_argument("--contexts", default="4096,8192", help="prompt lengths in tokens (approximate)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--drafters", default="sfi,streaming,ngram")
    ap.add_argument("--gammas", default="2,4,6,8,adaptive")
    ap.add_argument("--kv-budget", default="0.2", help="budget of the sfi and streaming drafters")
    ap.add_argument("--spec-refresh", default="every", choices=["every", "trigger", "both"])
    ap.add_argument("--passkey", action="store_true", help="also a passkey prompt per text and context")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the records here")
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    records = []
    print("| prompt | context | drafter | γ | refresh | acceptance | tokens/verification | decode tok/s | speedup vs full | = full KV |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, ctx, body in prompts(a.texts.split(","), contexts, a.passkey, a.seed):
            pf = os.path.join(tmp, "prompt.txt")
            with open(pf, "w", encoding="utf-8") as f:
                f.write(body)
            full = run(a.bin, a.model, pf, [], a.tokens, a.threads)
            print(f"| {label} | {full['prompt_tokens']} | full KV | - | - | - | 1.00 | "
                  f"{full['decode_tok_s']:.1f} | 1.00 | - |", flush=True)
            records.append({"prompt": label, "context": full["prompt_tokens"], "drafter": "full",
                            "decode_seconds": full["decode_seconds"], "decode_tok_s": full["decode_tok_s"]})
            refreshes = ["every", "trigger"] if a.spec_refresh == "both" else [a.spec_refresh]
            for d in a.drafters.split(","):
                for g in a.gammas.split(","):
                    for rf in (refreshes if d == "sfi" else ["every"]):
                        extra = ["--speculate", d, "--spec-tokens", g]
                        if d in ("sfi", "streaming"):
                            extra += ["--kv-budget", a.kv_budget]
                        if d == "sfi":
                            extra += ["--spec-refresh", rf]
                        r = run(a.bin, a.model, pf, extra, a.tokens, a.threads)
                        s = r["speculative"]
                        same = r["tokens"] == full["tokens"]
                        speed = full["decode_seconds"] / max(r["decode_seconds"], 1e-9)
                        rf_label = rf if d == "sfi" else "-"
                        print(f"| {label} | {r['prompt_tokens']} | {d} | {g} | {rf_label} | "
                              f"{100 * s['acceptance_rate']:.1f} % | {s['tokens_per_verification']:.2f} | "
                              f"{r['decode_tok_s']:.1f} | {speed:.2f} | {'yes' if same else 'NO'} |",
                              flush=True)
                        records.append({"prompt": label, "context": r["prompt_tokens"], "drafter": d,
                                        "spec_tokens": g, "refresh": rf_label, "identical": same,
                                        "speedup": speed, "decode_seconds": r["decode_seconds"],
                                        "decode_tok_s": r["decode_tok_s"], **s})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
