#!/usr/bin/env python3
"""Policy comparison at one context: reads the `slowfast eval --json` files of the nll, agree and
passkey tasks (one file per task and budget, all policies in each), prints the markdown table
(policy x budget: dNLL, agreement, passkey accuracy, KV MiB after prefill / at the end) and
writes an SVG with dNLL and passkey accuracy against the budget, one line per policy.

Usage: scripts/plot_results.py DIR [--out docs/img/policies-8k.svg]
DIR holds nll-B.json, agree-B.json and passkey-B.json for each budget B (e.g. nll-0.2.json).
Needs matplotlib for the plot (the table is printed without it).
"""
import argparse
import glob
import json
import os
import re

ORDER = ["full", "sfi", "sfi+fastkv", "streaming", "h2o", "snapkv", "pyramidkv", "quest", "fastkv"]


def load(d):
    """{task: {budget_fraction: {policy: record}}}"""
    out = {}
    for path in sorted(glob.glob(os.path.join(d, "*.json"))):
        m = re.match(r"(nll|agree|passkey)-([0-9.]+)\.json$", os.path.basename(path))
        if not m:
            continue
        task, b = m.group(1), float(m.group(2))
        with open(path) as f:
            recs = json.load(f)
        out.setdefault(task, {})[b] = {r["policy"]: r for r in recs}
    return out


def fmt(x, spec):
    return "–" if x is None else format(x, spec)


def table(data):
    budgets = sorted({b for t in data.values() for b in t})
    policies = [p for p in ORDER if any(p in t.get(b, {}) for t in data.values() for b in budgets)]
    rows = [
        "| policy | budget | tokens | Δnll vs full | agreement (E = 128) | first divergence | "
        "passkey | KV MiB after prefill | KV MiB end | retained |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 1 << 20
    def rec(task, b, p):
        if p == "full":  # independent of the budget: the first run that has it
            return next((r[p] for _, r in sorted(data.get(task, {}).items()) if p in r), None)
        return data.get(task, {}).get(b, {}).get(p)

    for p in policies:
        for b in budgets[:1] if p == "full" else budgets:
            nll, agr, pk = rec("nll", b, p), rec("agree", b, p), rec("passkey", b, p)
            if not (nll or agr or pk):
                continue
            any_rec = nll or agr or pk
            tokens = any_rec.get("kv_budget")
            pk_s = None if pk is None else f"{pk['correct']}/{pk['trials']}"
            rows.append(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                    p,
                    "–" if p == "full" else b,
                    "–" if tokens is None else tokens,
                    fmt(nll and (nll.get("delta_nll") or 0.0), "+.4f"),
                    fmt(agr and agr.get("agreement"), ".3f"),
                    "–" if not agr else ("none" if agr.get("first_divergence") is None
                                         else agr["first_divergence"]),
                    "–" if pk_s is None else pk_s,
                    fmt(nll and nll["kv_bytes_after_prefill"] / mib, ".1f"),
                    fmt(nll and nll["kv_bytes_end"] / mib, ".1f"),
                    fmt(nll and nll["retained_fraction"], ".3f"),
                )
            )
    return "\n".join(rows)


def plot(data, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, p in enumerate(ORDER):
        if p == "full":
            continue
        for ax, task, key in ((a1, "nll", "delta_nll"), (a2, "passkey", "accuracy")):
            pts = sorted(
                (b, recs[p][key]) for b, recs in data.get(task, {}).items() if p in recs
            )
            # Passkey accuracies coincide often: shift each policy a little sideways.
            dx = (i - 4.5) * 0.006 if task == "passkey" else 0.0
            if pts:
                style = "-o" if p.startswith("sfi") else "--s"
                ax.plot([b + dx for b, _ in pts], [v for _, v in pts], style, label=p, ms=4)
    full_pk = [recs["full"]["accuracy"] for recs in data.get("passkey", {}).values() if "full" in recs]
    if full_pk:
        a2.axhline(full_pk[0], color="k", lw=0.8, ls=":", label="full KV")
    a1.axhline(0.0, color="k", lw=0.8, ls=":")
    a1.set(xlabel="KV budget (fraction of the 8K context)", ylabel="Δnll vs full KV (nats/token)",
           title="NLL, E = 512 scored tokens")
    a2.set(xlabel="KV budget (fraction of the 8K context)", ylabel="accuracy",
           title="passkey retrieval ({} trials per point; points shifted sideways)".format(
               "/".join(sorted({str(r["trials"]) for recs in data.get("passkey", {}).values()
                                for r in recs.values()})) or "no"),
           ylim=(-0.05, 1.05))
    for ax in (a1, a2):
        ax.set_xticks(sorted({b for t in data.values() for b in t}))
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8, loc="upper right")
    fig.suptitle("Gemma 3 270M Q4_K_M, Pride and Prejudice, 8192 tokens (slowfast eval)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, format="svg", metadata={"Date": None})
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--out", default="docs/img/policies-8k.svg")
    a = ap.parse_args()
    data = load(a.dir)
    print(table(data))
    plot(data, a.out)


if __name__ == "__main__":
    main()
