#!/usr/bin/env python3
"""Tables and plot of the KV-policy comparison (scripts/compare_policies.py).

    scripts/compare_report.py DIR... [--plot docs/img/policies-compare.svg]

Reads every `slowfast eval --json` file in the DIRs, named as compare_policies.py names them
(ruler-<model>-<ctx>-<text>-<task>-<budget>-<group>.json, nll-<model>-<ctx>-<text>-<budget>-
<policy>.json, agree-<model>-<ctx>-<text>-<budget>[-<group>].json, passkey-<model>-<ctx>-<budget>-
<group>.json) plus diagnostic RULER runs diag-ruler-<model>-<ctx>-<text>-<budget>-every<N>.json
(oracle-sfi with --oracle-every N, shown as the policy `oracle-sfi/N`). Prints, per model and
context, a RULER table (each task's score and the prompts behind it, the average over the
tasks that ran for every policy of the row's model and context) and a table of NLL, teacher-
forced agreement and passkey accuracy; cells not run are `–`. --plot draws, per model, the
RULER average and Δnll of each policy at budget 0.2, --plot-budgets both against the budget at
each model's lower context (need matplotlib).

Files cuda-<kind>-<model>-<ctx>[-<text>]-<budget>.json (compare_policies.py --cuda-policies) hold
several policies run with --device cuda; their rows are the policy's name with a `†`, and their
Δnll is against full KV on the GPU (`full†`).

--variant LABEL=DIR (repeatable) adds the SFI records of DIR (compare_policies.py --sfi-variant:
the plan's SFI jobs with other flags) as the policy LABEL, and prints the targets table for it too.
Full-KV NLL records in DIR (run on the variant's machine) become `full[LABEL]`, the reference of
LABEL's Δnll: the same setting run on two machines differs by up to 0.02 nats on code.
"""
import argparse
import glob
import json
import os
import re
from collections import defaultdict

BASE = ["full", "sfi", "streaming", "h2o", "snapkv", "pyramidkv", "quest", "fastkv",
        "oracle", "oracle-sfi"]
ORDER = list(BASE)  # BASE with the --variant labels after sfi
MODELS = ["gemma3-270m", "smollm2-135m"]
M = r"(gemma3-270m|smollm2-135m)"


GPU = "†"  # marks a policy's results from a --device cuda job (cuda-<...>.json)


def porder(p):
    base = p.split("/")[0].rstrip(GPU)
    return (ORDER.index(base) if base in ORDER else 99, p)


def load(dirs, label=None):
    """Every record of the DIRs; with `label`, only their SFI records, as the policy `label`, and
    their full-KV records as `full[label]`."""
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
            with open(path) as f:
                recs = json.load(f)
            if label:
                names = {"sfi": label, "full": f"full[{label}]"}
                recs = [dict(r, policy=names[r["policy"]]) for r in recs if r["policy"] in names]
            if name.startswith("cuda-"):
                load_cuda(name[5:], recs, ruler, nll, agree, passkey)
            elif mt := re.fullmatch(rf"ruler-{M}-(\d+)-(\w+)-(niah_\w+|vt|cwe|fwe)-([0-9.]+)-.*", name):
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
                    full = r["policy"].startswith("full")
                    nll[(m, int(ctx), text, None if full else float(b), r["policy"])] = r
            elif mt := re.fullmatch(rf"agree-{M}-(\d+)-(\w+)-([0-9.]+)(-[\w-]+)?", name):
                m, ctx, text, b, _ = mt.groups()
                for r in recs:
                    bb = None if r["policy"] == "full" else float(b)
                    agree[(m, int(ctx), text, bb, r["policy"])] = r
            elif mt := re.fullmatch(rf"passkey-{M}-(\d+)-([0-9.]+)-.*", name):
                m, ctx, b = mt.groups()
                for r in recs:
                    bb = None if r["policy"] == "full" else float(b)
                    passkey[(m, int(ctx), bb, r["policy"])] = r
    return ruler, nll, agree, passkey


def load_cuda(name, recs, ruler, nll, agree, passkey):
    """A --device cuda job's records (compare_policies.py --cuda-policies: every policy of one
    cell and full KV in one file), each policy stored as `<policy>†`."""
    cell = rf"{M}-(\d+)-(\w+)-([0-9.]+)"
    for r in recs:
        p = r["policy"] + GPU
        if mt := re.fullmatch(rf"ruler-{cell}", name):
            m, ctx, text, b = mt.groups()
            bb = None if r["policy"] == "full" else float(b)
            for t in r["tasks"]:
                ruler[(m, int(ctx), text, bb)][p][t["task"]] = (t, r)
        elif mt := re.fullmatch(rf"(nll|agree)-{cell}", name):
            kind, m, ctx, text, b = mt.groups()
            bb = None if r["policy"] == "full" else float(b)
            (nll if kind == "nll" else agree)[(m, int(ctx), text, bb, p)] = r
        elif mt := re.fullmatch(rf"passkey-{M}-(\d+)-([0-9.]+)", name):
            m, ctx, b = mt.groups()
            passkey[(m, int(ctx), None if r["policy"] == "full" else float(b), p)] = r
        else:
            raise SystemExit(f"cuda-{name}.json: not a name compare_policies.py writes")


def delta(nll, m, ctx, text, b, p):
    """Δnll of policy row `p` at budget `b` against full KV on the same device (`full†` for a
    `†` row), or None where either was not run."""
    r = nll.get((m, ctx, text, b, p))
    f = nll.get((m, ctx, text, None, f"full[{p}]")) or \
        nll.get((m, ctx, text, None, "full" + (GPU if p.endswith(GPU) else "")))
    return None if r is None or f is None else r["nll"] - f["nll"]


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
            d = delta(nll, m, ctx, text, b, p)
            cells.append("–" if r is None else f"{r['nll']:.4f}")
            cells.append("–" if d is None else f"{d:+.4f}")
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


def pyplot():
    """matplotlib's pyplot without a display, drawing the same SVG from the same data."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "slowfast"
    import matplotlib.pyplot as plt

    return plt


def palette(plt):
    """A colour per policy: tab10 for BASE, then dark shades for the --variant labels."""
    colors = {p: plt.cm.tab10(i) for i, p in enumerate(BASE)}
    extra = [p for p in ORDER if p not in colors]
    colors.update({p: plt.cm.Dark2(i % 8) for i, p in enumerate(extra)})
    return colors


def save(fig, out):
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, format=out.rsplit(".", 1)[-1],
                metadata={"Date": None} if out.endswith("svg") else None)
    print(f"wrote {out}")


def plot(ruler, nll, contexts, out, budget=0.2):
    plt = pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), gridspec_kw={"width_ratios": [1.3, 1]})
    colors = palette(plt)
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
    save(fig, out)


def targets(ruler, nll, contexts, sfi_name="sfi"):
    """SFI (or the variant `sfi_name`) against full KV and the best other non-oracle policy
    (today's SFI and the variants excluded), per model, context and budget: the RULER average
    (prose haystack, rows with every task) and Δnll on prose and code. A policy's CPU row is
    used where it exists, else its GPU row (marked †)."""
    others = [p for p in BASE if p not in ("full", "sfi", "oracle", "oracle-sfi")]
    lines = [f"| model, context | budget | RULER full | RULER {sfi_name} | best other RULER | "
             f"Δnll prose {sfi_name} | best other Δnll prose | Δnll code {sfi_name} | "
             "best other Δnll code |",
             "|---|---|---|---|---|---|---|---|---|"]

    def pick(table, p):  # (value, name) from the CPU row, else the GPU row
        for name in (p, p + GPU):
            if table.get(name) is not None:
                return table[name], name
        return None, None

    for m in MODELS:
        for ctx in contexts.get(m, []):
            avgs = ruler_table(ruler, m, ctx)[1]
            for b in (0.1, 0.2, 0.5):
                r = {p: avgs.get((p, None if p.startswith("full") else b))
                     for p in ["full", "full" + GPU] + [q + g for q in ORDER[1:] for g in ("", GPU)]}
                full, _ = pick(r, "full")
                sfi, sn = pick(r, sfi_name)
                best = [pick(r, p) for p in others]
                best = [x for x in best if x[0] is not None]
                top = max(v for v, _ in best) if best else None
                tops = ", ".join(n for v, n in best if v == top)
                cells = [f"{m} {ctx // 1024}K", str(b), "–" if full is None else f"{full:.1f}",
                         "–" if sfi is None else f"{sfi:.1f}" + (GPU if sn.endswith(GPU) else ""),
                         "–" if top is None else f"{top:.1f} ({tops})"]
                for text in ("prose", "code"):
                    d = {}
                    for p in ORDER[1:]:
                        v, name = pick({n: delta(nll, m, ctx, text, b, n) for n in (p, p + GPU)}, p)
                        if v is not None:
                            d[p] = (v, name)
                    sv = d.get(sfi_name)
                    ob = sorted((v, n) for p, (v, n) in d.items() if p in others)
                    cells.append("–" if sv is None else f"{sv[0]:+.4f}" + (GPU if sv[1].endswith(GPU) else ""))
                    cells.append("–" if not ob else f"{ob[0][0]:+.4f} ({ob[0][1]})")
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_budgets(ruler, nll, contexts, out):
    """Per model at its lower context (all CPU runs): the RULER average (prose haystack) and
    Δnll on prose and on code against the budget, one line per policy."""
    plt = pyplot()

    fig, axes = plt.subplots(len(MODELS), 3, figsize=(15, 4.2 * len(MODELS)))
    colors = palette(plt)
    for row, m in enumerate(MODELS):
        cs = contexts.get(m, [])
        if not cs:
            continue
        ctx = cs[0]
        avgs = ruler_table(ruler, m, ctx)[1]
        full = avgs.get(("full", None))
        ax = axes[row][0]
        for p in ORDER[1:]:
            pts = sorted((b, v) for (pp, b), v in avgs.items() if pp == p and b is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colors[p], label=p)
        if full is not None:
            ax.axhline(full, color=colors["full"], ls="--", lw=1, label="full")
        ax.set(xlabel="KV budget (fraction of the context)", ylabel="RULER average (0–100)",
               title=f"{m} {ctx // 1024}K: RULER (prose haystack)", ylim=(-4, 104))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        for col, text in ((1, "prose"), (2, "code")):
            ax = axes[row][col]
            f = nll.get((m, ctx, text, None, "full"))
            if f is None:
                continue
            for p in ORDER[1:]:
                pts = sorted((k[3], r["nll"] - f["nll"]) for k, r in nll.items()
                             if k[:3] == (m, ctx, text) and k[4] == p and k[3] is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=colors[p], label=p)
            ax.axhline(0.0, color="k", lw=0.8)
            ax.set(xlabel="KV budget (fraction of the context)", ylabel="Δnll vs full KV (nats/token)",
                   title=f"{m} {ctx // 1024}K: Δnll on {text}")
            ax.grid(alpha=0.3)
    save(fig, out)


def add_variant(spec, ruler, nll, agree, passkey):
    """--variant LABEL=DIR: DIR's SFI (and full-KV) records into the tables, LABEL after sfi in
    ORDER; returns LABEL."""
    label, _, d = spec.partition("=")
    if not label or not d or label in ORDER or not os.path.isdir(d):
        raise SystemExit(f"--variant {spec}: expected LABEL=DIR with a new LABEL and a folder")
    ORDER.insert(ORDER.index("sfi") + 1 + sum(p not in BASE for p in ORDER), label)
    r2, n2, a2, p2 = load([d], label)
    for k, pols in r2.items():
        for p, tasks in pols.items():
            ruler[k][p].update(tasks)
    nll.update(n2)
    agree.update(a2)
    passkey.update(p2)
    return label


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--plot", help="SVG/PNG: every policy at budget 0.2")
    ap.add_argument("--plot-budgets", help="SVG/PNG: every policy against the budget, lower contexts")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=DIR",
                    help="DIR's SFI records as the policy LABEL (compare_policies.py --sfi-variant)")
    a = ap.parse_args()
    ruler, nll, agree, passkey = load(a.dirs)
    labels = [add_variant(v, ruler, nll, agree, passkey) for v in a.variant]
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
    print("\n#### SFI against the best other policy, every budget\n\n" + targets(ruler, nll, contexts))
    for label in labels:
        print(f"\n#### {label} against the best other policy, every budget\n\n"
              + targets(ruler, nll, contexts, label))
    if a.plot:
        plot(ruler, nll, contexts, a.plot)
    if a.plot_budgets:
        plot_budgets(ruler, nll, contexts, a.plot_budgets)


if __name__ == "__main__":
    main()
