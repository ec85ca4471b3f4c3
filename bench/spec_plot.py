#!/usr/bin/env python3
"""Speculative decoding on the GPU: speedup over full KV against γ, from the JSON files of
`slowfast bench --device cuda --speculate ... --json` (scripts/gpu_spec.sh bench writes
spec-b1.json and spec-b6.json).

    bench/spec_plot.py spec-b1.json spec-b6.json --out docs/img/spec-gamma.svg [--md table.md]

One panel per batch size, one line per (drafter, context). Needs matplotlib.
"""
import argparse
import json


def load(paths):
    recs = []
    for p in paths:
        j = json.load(open(p))
        recs.extend(j["speculative"] if isinstance(j, dict) else [])
    return recs


def drafter(r):
    """The drafter, with SFI's refresh schedule when it refreshed on the trigger (the interval)
    instead of from every verification."""
    d = r["drafter"]
    return d + " trigger" if d == "sfi" and not r.get("refresh_every", True) else d


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True, help="the SVG to write")
    ap.add_argument("--md", help="also write the records as a markdown table here")
    a = ap.parse_args()
    recs = load(a.files)
    if not recs:
        raise SystemExit("no speculative records in " + ", ".join(a.files))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in recs})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    styles = {"sfi": "-", "sfi trigger": "-.", "streaming": "--", "ngram": ":"}
    for ax, b in zip(axes[0], batches):
        rs = [r for r in recs if r["batch"] == b]
        for d in ["sfi", "sfi trigger", "streaming", "ngram"]:
            for ctx in sorted({r["context"] for r in rs}):
                pts = sorted((r["gamma"], r["speedup_vs_full"]) for r in rs if drafter(r) == d and r["context"] == ctx)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(d, "-"), marker="o",
                            label=f"{d} {ctx // 1024}K")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"batch {b}: speculative decoding over full KV")
        ax.set_xlabel("γ (drafted tokens per verification)")
        ax.set_ylabel("speedup over full KV (tok/s)")
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"H200, Qwen3-4B shapes, random weights; acceptance {recs[0]['acceptance']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out)
    if a.md:
        with open(a.md, "w") as o:
            o.write("| context | batch | drafter | γ | tokens / verification | tok/s | vs full KV | draft ms | verify ms |\n")
            o.write("|---|---|---|---|---|---|---|---|---|\n")
            for r in sorted(recs, key=lambda r: (r["context"], r["batch"], drafter(r), r["gamma"])):
                o.write(f"| {r['context']} | {r['batch']} | {drafter(r)} | {r['gamma']} | "
                        f"{r['tokens_per_verification']:.2f} | {r['tok_s']:.1f} | {r['speedup_vs_full']:.2f}x | "
                        f"{r['draft_ms_per_round']:.2f} | {r['verify_ms_per_round']:.2f} |\n")


if __name__ == "__main__":
    main()
