#!/usr/bin/env python3
"""The KV-policy comparison of issue 21 (every policy at several budgets; RULER, NLL, passkey and
teacher-forced agreement; two models, two contexts each, prose and source code), as many small
single-threaded `slowfast eval` processes run side by side.

    scripts/compare_policies.py jobs [SCALE]             # print the commands, in priority order
    scripts/compare_policies.py run  [SCALE] --out DIR [--workers 16] [--end-in SECONDS]

Every job is one `slowfast eval --threads 1 ... --json DIR/<name>.json` command. Policies that
continue a shared dense prefill (full, streaming, oracle, oracle-sfi fork from SFI's prefill)
run in SFI's process; every other policy needs its own prefill and gets its own process.
Jobs are ordered by tier (--max-tier drops the later ones), the longest first within a tier.
`run` starts the next job whose model file exists whenever a worker is free (`--model NAME=PATH`
lets the files arrive while it runs), starts none that its cost estimate says would end after
--end-in, kills what still runs then, and skips jobs whose JSON is already in DIR (so a run can
be resumed). scripts/compare_report.py turns DIR into the tables and the plot.

SCALE (defaults: the scale of the run in docs/results.md):
  --contexts gemma3-270m=8192,16384 smollm2-135m=4096,8192
  --texts prose=data/texts/austen_prideprejudice.txt code=data/texts/rust_serde_json.txt
  --budgets 0.1,0.2,0.5   --oracle-budget 0.2
  --ruler-tasks gemma3-270m=...  smollm2-135m=...   --ruler-samples 3 --ruler-samples-other 1 --ruler-samples-high 1
  --nll-tokens 512  --agree-tokens 64  --passkey-trials 3
Texts: scripts/get_texts.sh (prose), scripts/get_code_text.sh (code).
"""
import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

SPARSE = ["sfi", "streaming", "h2o", "snapkv", "pyramidkv", "quest", "fastkv"]
# Policies that need a prefill of their own (the others fork from SFI's).
OWN_PREFILL = ["sfi", "h2o", "snapkv", "pyramidkv", "quest", "fastkv"]
CHAT = {"smollm2-135m"}
# RULER tasks whose haystack is the --input text (the others do not depend on it).
ESSAY_TASKS = {"niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue",
               "niah_multiquery"}  # instruct models: RULER prompts in the chat template
DEFAULT_TASKS = {
    "gemma3-270m": "niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2",
    "smollm2-135m": "niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2",
}
# Single-thread prefill seconds of a 4K prompt (2026-12 VM) and decode seconds per token, for
# ordering and for the deadline only.
PREFILL_4K = {"gemma3-270m": 29.0, "smollm2-135m": 29.0}
QUADRATIC = {"gemma3-270m": 0.15, "smollm2-135m": 0.45}  # attention share of the 4K prefill


def prefill_cost(model, ctx):
    r = ctx / 4096
    q = QUADRATIC.get(model, 0.3)
    return PREFILL_4K.get(model, 40.0) * r * ((1 - q) + q * r)


def decode_cost(model, ctx):
    return 0.02 + 0.01 * ctx / 4096


def groups(budget, oracle_budget):
    """Policy lists, one per process, at one budget."""
    first = ["sfi", "streaming"]
    if abs(budget - oracle_budget) < 1e-9:
        first = ["sfi", "full", "streaming", "oracle", "oracle-sfi"]
    return [first] + [[p] for p in OWN_PREFILL[1:]]


class Job:
    def __init__(self, tier, name, model, argv, cost):
        self.tier, self.name, self.model, self.argv, self.cost = tier, name, model, argv, cost

    def cmd(self, binary, out, model_path):
        a = [binary, "eval", "-m", model_path.get(self.model, self.model), "--threads", "1"]
        a += self.argv + ["--json", os.path.join(out, self.name + ".json")]
        return a


def make_jobs(a):
    jobs = []
    ctxs = {}
    for spec in a.contexts:
        m, cs = spec.split("=")
        ctxs[m] = [int(c) for c in cs.split(",")]
    texts = dict(t.split("=", 1) for t in a.texts)
    tasks = dict(DEFAULT_TASKS)
    tasks.update(dict(t.split("=", 1) for t in a.ruler_tasks))
    budgets = [float(b) for b in a.budgets.split(",")]
    ob = a.oracle_budget

    def add(tier, name, model, argv, cost):
        jobs.append(Job(tier, name, model, argv, cost))

    for m, cs in ctxs.items():
        for ci, ctx in enumerate(cs):
            low = ci == 0  # the lower context of each model comes first
            P, D = prefill_cost(m, ctx), decode_cost(m, ctx)
            for ti, (tname, tpath) in enumerate(texts.items()):
                prose = ti == 0
                # RULER: one process per task, budget and policy group; at the lower context
                # --ruler-samples prompts per task (depths 0 .. 100 %) at --oracle-budget and
                # --ruler-samples-other at the other budgets, at the higher context
                # --ruler-samples-high (1: depth 50 %). The second text only changes the essay
                # haystacks.
                for task in tasks[m].split(","):
                    if not prose and task not in ESSAY_TASKS:
                        continue
                    for b in budgets:
                        at_ob = abs(b - ob) < 1e-9
                        S = (a.ruler_samples if at_ob else a.ruler_samples_other) if low \
                            else a.ruler_samples_high
                        if prose:
                            tier = (1 if low else 2) if at_ob else (4 if low else 6)
                        else:
                            tier = 5 if (at_ob and low) else 6
                        for g in groups(b, ob):
                            argv = ["--task", "ruler", "-i", tpath, "--context", str(ctx),
                                    "--ruler-tasks", task, "--ruler-samples", str(S),
                                    "--seed", "0", "--policies", ",".join(g), "--kv-budget", str(b)]
                            if m in CHAT:
                                argv.append("--chat")
                            cost = S * (P + len(g) * 100 * D)
                            add(tier, f"ruler-{m}-{ctx}-{tname}-{task}-{b}-{g[0]}", m, argv, cost)
                # NLL: one process per policy and budget (each prefills on its own).
                for b in budgets:
                    at_ob = abs(b - ob) < 1e-9
                    pols = list(SPARSE) + (["full", "oracle", "oracle-sfi"] if at_ob else [])
                    for p in pols:
                        tier = (2 if prose else 3) if low else (5 if at_ob else 6)
                        argv = ["--task", "nll", "-i", tpath, "--context", str(ctx),
                                "--eval-tokens", str(a.nll_tokens), "--policies", p,
                                "--kv-budget", str(b)]
                        cost = P + a.nll_tokens * D * (3 if p.startswith("oracle") else 1)
                        add(tier, f"nll-{m}-{ctx}-{tname}-{b}-{p}", m, argv, cost)
                # Teacher-forced agreement: all policies of a budget in one process (full KV,
                # the reference, comes along).
                for b in budgets:
                    at_ob = abs(b - ob) < 1e-9
                    pols = list(SPARSE) + (["oracle", "oracle-sfi"] if at_ob else [])
                    tier = (3 if at_ob else 5) if low else 6
                    argv = ["--task", "agree", "-i", tpath, "--context", str(ctx),
                            "--eval-tokens", str(a.agree_tokens), "--policies", ",".join(pols),
                            "--kv-budget", str(b)]
                    cost = 8 * P + 2 * len(pols) * a.agree_tokens * D
                    add(tier, f"agree-{m}-{ctx}-{tname}-{b}", m, argv, cost)
            # Passkey (haystack: the first text), one process per budget and policy group.
            for b in budgets:
                at_ob = abs(b - ob) < 1e-9
                tier = (3 if at_ob else 5) if low else 6
                if m in CHAT:  # completion-style prompts; the instruct model is weak at them
                    tier = 6
                for g in groups(b, ob):
                    argv = ["--task", "passkey", "-i", list(texts.values())[0], "--context",
                            str(ctx), "--passkey-trials", str(a.passkey_trials),
                            "--passkey-depths", "0.1,0.5,0.9", "--seed", "1",
                            "--policies", ",".join(g), "--kv-budget", str(b)]
                    cost = a.passkey_trials * (P + len(g) * 8 * D)
                    add(tier, f"passkey-{m}-{ctx}-{b}-{g[0]}", m, argv, cost)
    jobs = [j for j in jobs if j.tier <= a.max_tier]
    jobs.sort(key=lambda j: (j.tier, -j.cost))
    return jobs


def run(a, jobs):
    os.makedirs(a.out, exist_ok=True)
    logs = os.path.join(a.out, "logs")
    os.makedirs(logs, exist_ok=True)
    model_path = dict(x.split("=", 1) for x in a.model)
    t0 = time.time()
    end = t0 + a.end_in if a.end_in else None
    pending = [j for j in jobs if not os.path.exists(os.path.join(a.out, j.name + ".json"))]
    running = {}  # pid -> (job, Popen, start)
    ratios = []  # measured / estimated seconds of finished jobs
    state = open(os.path.join(a.out, "runner.log"), "a")

    def log(msg):
        state.write(f"{time.time() - t0:8.1f} {msg}\n")
        state.flush()

    def ready(j):
        p = model_path.get(j.model)
        return p is None or os.path.exists(p)

    log(f"start: {len(pending)} jobs, {a.workers} workers, end in {a.end_in}")
    stop_file = os.path.join(a.out, "STOP")
    while pending or running:
        for pid, (j, pr, st) in list(running.items()):
            rc = pr.poll()
            if rc is not None:
                del running[pid]
                secs = time.time() - st
                ratios.append(secs / j.cost)
                log(f"done rc={rc} {secs:.0f}s (est {j.cost:.0f}) {j.name}")
        now = time.time()
        if end and now > end:
            for pid, (j, pr, st) in running.items():
                pr.kill()
                log(f"killed at the end: {j.name}")
            break
        ratio = sorted(ratios)[len(ratios) // 2] if ratios else 1.0
        while len(running) < a.workers and pending and not os.path.exists(stop_file):
            cand = [j for j in pending if ready(j)]
            if end:
                cand = [j for j in cand if now + j.cost * ratio * 1.15 < end]
            if not cand:
                break
            j = cand[0]
            pending.remove(j)
            err = open(os.path.join(logs, j.name + ".err"), "w")
            pr = subprocess.Popen(j.cmd(a.bin, a.out, model_path), stdout=subprocess.DEVNULL,
                                  stderr=err, env=dict(os.environ, RAYON_NUM_THREADS="1"))
            running[pr.pid] = (j, pr, time.time())
            log(f"start (tier {j.tier}, est {j.cost * ratio:.0f}s) {j.name}")
        if not running and pending:
            if not any(ready(j) for j in pending):
                time.sleep(2)
                continue
            if end and not [j for j in pending if ready(j) and time.time() + j.cost * ratio * 1.15 < end]:
                log(f"nothing more fits: {len(pending)} jobs left")
                break
            if os.path.exists(stop_file):
                break
        time.sleep(1)
    log(f"finished: {len(pending)} jobs not run")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["jobs", "run"])
    ap.add_argument("--contexts", nargs="+",
                    default=["gemma3-270m=8192,16384", "smollm2-135m=4096,8192"])
    ap.add_argument("--texts", nargs="+", default=[
        "prose=data/texts/austen_prideprejudice.txt", "code=data/texts/rust_serde_json.txt"])
    ap.add_argument("--budgets", default="0.1,0.2,0.5")
    ap.add_argument("--oracle-budget", type=float, default=0.2)
    ap.add_argument("--ruler-tasks", nargs="*", default=[])
    ap.add_argument("--ruler-samples", type=int, default=3)
    ap.add_argument("--ruler-samples-high", type=int, default=1)
    ap.add_argument("--ruler-samples-other", type=int, default=1)
    ap.add_argument("--nll-tokens", type=int, default=512)
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--passkey-trials", type=int, default=3)
    ap.add_argument("--max-tier", type=int, default=6)
    ap.add_argument("--bin", default="target/release/slowfast")
    ap.add_argument("--model", nargs="*", default=[], help="NAME=PATH of a model file")
    ap.add_argument("--out", default="out/compare")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--end-in", type=float, default=0, help="seconds; 0: no deadline")
    a = ap.parse_args()
    jobs = make_jobs(a)
    if a.what == "jobs":
        mp = dict(x.split("=", 1) for x in a.model)
        tot = {}
        for j in jobs:
            tot[j.tier] = tot.get(j.tier, 0) + j.cost
            print(f"# tier {j.tier} est {j.cost:.0f}s")
            print(shlex.join(j.cmd(a.bin, a.out, mp)))
        print(f"# {len(jobs)} jobs; estimated single-thread seconds per tier: "
              + ", ".join(f"{t}: {c:.0f}" for t, c in sorted(tot.items())), file=sys.stderr)
    else:
        run(a, jobs)


if __name__ == "__main__":
    main()
