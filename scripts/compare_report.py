#!/usr/bin/env python3
"""Tables and plot of the KV-policy comparison (scripts/compare_policies.py).

    scripts/compare_report.py DIR... [--plot docs/img/policies-compare.svg]

Reads every `slowfast eval --json` file in the DIRs, named as compare_policies.py names them
(ruler-<model>-<ctx>-<text>-<task>-<budget>-<group>.json, nll-<model>-<ctx>-<text>-<budget>-
<policy>.json, agree-<model>-<ctx>-<text>-<budget>.json, passkey-<model>-<ctx>-<budget>-
<group>.json) plus diagnostic RULER runs diag-ruler-<model>-<ctx>-<text>-<budget>-every<N>.json
(oracle-sfi with --oracle-every N, shown as the policy `oracle-sfi/N`). Prints, per model and
context, a RULER table (each task's score and the prompts behind it, the average over the
tasks that ran for every policy of the row's model and context) and a table of NLL, teacher-
forced agreement and passkey accuracy; cells not run are `–`. --plot draws, per model, the
RULER average and Δnll of each policy at budget 0.2 (needs matplotlib).
"""
import argparse
import glob
import json
import os
import re
from collections import defaultdict

ORDER = ["full", "sfi", "streaming", "h2o", "snapkv", "pyramidkv", "quest", "fastkv",
         "oracle", "oracle-sfi"]
MODELS = ["gemma3-270m", "smollm2-135m"]
M = r"(gemma3-270m|smollm2-135m)"


def porder(p):
    base = p.split("/")[0]
    return (ORDER.index(base) if base in ORDER else 99, p)


def load(dirs):
    ruler = defaultdict(lambda: defaultdict(dict))  # (m, ctx, text, b) -> policy -> task -> rec
    nll = {}  # (m, ctx, text, b, policy) -> rec
    agree = {}  # (m, ctx, text, b, policy) -> rec
    passkey = {}  # (m, ctx, b, policy) -> rec
    seen = set()
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.json"))):
            name = os.path.basename(path)[:-5]
            if name in seen:
                continue
            seen.add(name)
            recs = json.load(open(path))
            if mt := re.fullmatch(rf"ruler-{M}-(\d+)-(\w+)-(niah_\w+|vt|cwe|fwe)-([0-9.]+)-.*", name):
                m, ctx, text, _, b = mt.groups()
                for r in recs:
                    bb = None if r["policy"] == "full" else float(b)
                    for t in r["tasks"]:
                        ruler[(m, int(ctx), text, bb)][r["policy"]][t["task"]] = (t, r)
            elif mt := re.fullmatch(rf"diag-ruler-{M}-(\d+)-(\w+)-([0-9.]+)-every(\d+)", name):
                m, ctx, text, b, n = mt.groups()
                for r in recs:
                    for t in r["tasks"]:
                        ruler[(m, int(ctx), text, float(b))][f"{r['policy']}/{n}"][t["task"]] = (t, r)
            elif mt := re.fullmatch(rf"nll-{M}-(\d+)-(\w+)-([0-9.]+)-(.*)", name):
                m, ctx, text, b, p = mt.groups()
                for r in recs:
                    nll[(m, int(ctx), text, None if p == "full" else float(b), r["policy"])] = r
            elif mt := re.fullmatch(rf"agree-{M}-(\d+)-(\w+)-([0-9.]+)", name):
                m, ctx, text, b = mt.groups()
                for r in recs:
                    bb = None if r["policy"] == "full" else float(b)
                    agree[(m, int(ctx), text, bb, r["policy"])] = r
            elif mt := re.fullmatch(rf"passkey-{M}-(\d+)-([0-9.]+)-.*", name):
                m, ctx, b = mt.groups()
                for r in recs:
                    bb = None if r["policy"] == "full" else float(b)
                    passkey[(m, int(ctx), bb, r["policy"])] = r
    return ruler, nll, agree, passkey


def ruler_rows(ruler, m, ctx, text="prose"):
    """[(policy, budget, {task: (score, n, per-prompt scores)}, retained)]"""
    out = []
    for (mm, c, t, b), pols in ruler.items():
        if (mm, c, t) != (m, ctx, text):
            continue
        for p, tasks in pols.items():
            sc = {k: (v[0]["score"], v[0]["samples"], [a["score"] for a in v[0]["answers"]])
                  for k, v in tasks.items()}
            ret = [v[1]["retained_fraction"] for v in tasks.values()]
            out.append((p, b, sc, sum(ret) / len(ret)))
    out.sort(key=lambda x: (porder(x[0]), x[1] or 0))
    return out


def ruler_table(ruler, m, ctx, text="prose"):
    rows = ruler_rows(ruler, m, ctx, text)
    if not rows:
        return None, {}
    tasks = sorted({k for _, _, sc, _ in rows for k in sc})
    hdr = "| policy | budget | " + " | ".join(tasks) + " | average | prompts | retained |"
    lines = [hdr, "|" + "---|" * (len(tasks) + 5)]
    avgs = {}
    for p, b, sc, ret in rows:
        cells = []
        for k in tasks:
            if k in sc:
                s, n, per = sc[k]
                cells.append(f"{s:.0f} ({'/'.join(f'{x:.0f}' for x in per)})")
            else:
                cells.append("–")
        full = len(sc) == len(tasks)
        avg = sum(v[0] for v in sc.values()) / len(sc)
        n = sum(v[1] for v in sc.values())
        if full:
            avgs[(p, b)] = avg
        avg_s = f"**{avg:.1f}**" if full else f"({avg:.1f}, {len(sc)} of {len(tasks)} tasks)"
        lines.append(f"| {p} | {'–' if b is None else b} | " + " | ".join(cells)
                     + f" | {avg_s} | {n} | {ret:.3f} |")
    return "\n".join(lines), avgs


def other_table(nll, agree, passkey, m, ctx):
    keys = set()
    for k in nll:
        if k[:2] == (m, ctx):
            keys.add((k[4], k[3]))
    for k in agree:
        if k[:2] == (m, ctx):
            keys.add((k[4], k[3]))
    for k in passkey:
        if k[:2] == (m, ctx):
            keys.add((k[3], k[2]))
    if not keys:
        return None
    lines = ["| policy | budget | nll prose | Δnll prose | nll code | Δnll code | "
             "TF agreement prose | TF agreement code | passkey | retained (nll prose) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p, b in sorted(keys, key=lambda x: (porder(x[0]), x[1] or 0)):
        cells = []
        for text in ("prose", "code"):
            r = nll.get((m, ctx, text, b, p))
            f = nll.get((m, ctx, text, None, "full"))
            cells.append("–" if r is None else f"{r['nll']:.4f}")
            cells.append("–" if r is None or f is None else f"{r['nll'] - f['nll']:+.4f}")
        for text in ("prose", "code"):
            r = agree.get((m, ctx, text, b, p))
            cells.append("–" if r is None else
                         f"{r['teacher_forced_agreement']:.3f} ({round(r['teacher_forced_agreement'] * r['eval_tokens'])}/{r['eval_tokens']})")
        r = passkey.get((m, ctx, b, p))
        cells.append("–" if r is None else f"{r['correct']}/{r['trials']}")
        r = nll.get((m, ctx, "prose", b, p))
        cells.append("–" if r is None else f"{r['retained_fraction']:.3f}")
        lines.append(f"| {p} | {'–' if b is None else b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(ruler, nll, contexts, out, budget=0.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), gridspec_kw={"width_ratios": [1.3, 1]})
    colors = {p: plt.cm.tab10(i) for i, p in enumerate(ORDER)}
    for row, m in enumerate(MODELS):
        cs = contexts.get(m, [])
        # RULER average at `budget` (bars), one bar per context: rows with every task only.
        ax = axes[row][0]
        avgs = {ctx: ruler_table(ruler, m, ctx)[1] for ctx in cs}
        extra = sorted({p for a in avgs.values() for p, _ in a if "/" in p}, key=porder)
        pols = ORDER + extra
        width = 0.8 / max(1, len(cs))
        for ci, ctx in enumerate(cs):
            ys = [avgs[ctx].get((p, None if p == "full" else budget)) for p in pols]
            xs = [i + (ci - (len(cs) - 1) / 2) * width for i in range(len(pols))]
            ok = [(x, y, colors.get(p.split("/")[0], "grey")) for x, y, p in zip(xs, ys, pols)
                  if y is not None]
            ax.bar([o[0] for o in ok], [o[1] for o in ok], width=width * 0.95,
                   color=[o[2] for o in ok], alpha=0.9 if ci == 0 else 0.5,
                   hatch=None if ci == 0 else "//", edgecolor="k", lw=0.4)
            for x, y, _ in ok:
                ax.text(x, y + 1, f"{y:.0f}", ha="center", fontsize=6)
        ax.set_xticks(range(len(pols)))
        ax.set_xticklabels(pols, rotation=45, ha="right", fontsize=8)
        ax.set(ylabel="RULER average over the tasks (0–100)", ylim=(0, 108),
               title=f"{m}: RULER at budget {budget} (solid {cs[0] // 1024}K"
               + (f", hatched {cs[1] // 1024}K)" if len(cs) > 1 else ")"))
        ax.grid(axis="y", alpha=0.3)
        # Δnll at `budget`, the lower context, prose (solid) and code (hatched).
        ax = axes[row][1]
        ctx = cs[0] if cs else None
        pols = [p for p in ORDER if p != "full"]
        for ti, text in enumerate(("prose", "code")):
            f = nll.get((m, ctx, text, None, "full"))
            if f is None:
                continue
            ys = [nll.get((m, ctx, text, budget, p)) for p in pols]
            xs = [i + (ti - 0.5) * 0.4 for i in range(len(pols))]
            ok = [(x, r["nll"] - f["nll"], colors[p]) for x, r, p in zip(xs, ys, pols) if r]
            ax.bar([o[0] for o in ok], [o[1] for o in ok], width=0.38,
                   color=[o[2] for o in ok], alpha=0.9 if ti == 0 else 0.5,
                   hatch=None if ti == 0 else "//", edgecolor="k", lw=0.4)
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xticks(range(len(pols)))
        ax.set_xticklabels(pols, rotation=45, ha="right", fontsize=8)
        ax.set(ylabel="Δnll vs full KV (nats/token)",
               title=f"{m} {ctx // 1024 if ctx else 0}K: Δnll at {budget} "
               "(solid prose, hatched code)")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, format=out.rsplit(".", 1)[-1],
                metadata={"Date": None} if out.endswith("svg") else None)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--plot")
    a = ap.parse_args()
    ruler, nll, agree, passkey = load(a.dirs)
    contexts = defaultdict(set)
    for k in list(ruler) + list(nll) + list(agree):
        contexts[k[0]].add(k[1])
    contexts = {m: sorted(c) for m, c in contexts.items()}
    for m in MODELS:
        for ctx in contexts.get(m, []):
            for text in ("prose", "code"):
                t, _ = ruler_table(ruler, m, ctx, text)
                if t:
                    print(f"\n#### {m}, {ctx} tokens: RULER ({text} haystack)\n\n{t}")
            t = other_table(nll, agree, passkey, m, ctx)
            if t:
                print(f"\n#### {m}, {ctx} tokens: NLL, teacher-forced agreement, passkey\n\n{t}")
    if a.plot:
        plot(ruler, nll, contexts, a.plot)


if __name__ == "__main__":
    main()
