#!/usr/bin/env python3
"""Plot `slowfast bench --device cuda --policies ...` records: decode tok/s per policy against
context and the speedup over full KV, as one SVG (every policy the records hold).

    python3 scripts/plot_gpu_sfi.py OUT.svg RUN-b1.json [RUN-bN.json ...]

Each JSON file is the array `--json` writes. Records of batch 1 draw the lines; records of a
larger batch are drawn as markers at their context with the batch in the legend. Uses
matplotlib (pip install matplotlib)."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, files = sys.argv[1], sys.argv[2:]
    recs = []
    for f in files:
        with open(f) as fh:
            recs.extend(json.load(fh))
    if not recs:
        sys.exit("no records")
    colors = {"full": "#444444", "sfi": "#d62728", "streaming": "#1f77b4", "snapkv": "#2ca02c",
              "pyramidkv": "#9467bd"}
    policies = list(dict.fromkeys(r["policy"] for r in recs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    batches = sorted({r["batch"] for r in recs})
    for b in batches:
        for pol in policies:
            rs = sorted((r for r in recs if r["batch"] == b and r["policy"] == pol), key=lambda r: r["context"])
            if not rs:
                continue
            xs = [r["context"] / 1024 for r in rs]
            ys = [r["decode_tok_s"] for r in rs]
            style = "-o" if b == 1 else "--s"
            ax1.plot(xs, ys, style, color=colors.get(pol), label=f"{pol}, batch {b}", ms=6 if b == 1 else 9)
            full = {r["context"]: r["decode_tok_s"] for r in recs if r["batch"] == b and r["policy"] == "full"}
            sp = [(r["context"] / 1024, r["decode_tok_s"] / full[r["context"]]) for r in rs if r["context"] in full]
            if pol != "full" and sp:
                ax2.plot([p[0] for p in sp], [p[1] for p in sp], style, color=colors.get(pol),
                         label=f"{pol}, batch {b}", ms=6 if b == 1 else 9)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("decode tok/s (summed over the batch)")
    ax2.set_ylabel("speedup over full KV (same batch)")
    ax2.axhline(1.0, color="#888888", lw=0.8)
    name = recs[0].get("model", "")
    dev = recs[0].get("device_name", "")
    fig.suptitle(f"{name} on {dev}: decode by KV policy ({', '.join(policies)})")
    fig.tight_layout()
    fig.savefig(out, format="svg")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
