#!/usr/bin/env python3
"""The KV-policy comparison of issue 21 (every policy at several budgets; RULER, NLL, passkey and
teacher-forced agreement; two models, two contexts each, prose and source code), as many small
single-threaded `slowfast eval` processes run side by side.

    scripts/compare_policies.py jobs [SCALE]             # print the commands, in priority order
    scripts/compare_policies.py run  [SCALE] --out DIR [--workers 16] [--end-in SECONDS]
        [--done DIR...] [--cuda-policies full,sfi,streaming,snapkv,pyramidkv,quest,h2o --gpu-workers 2]
        [--sfi-variant 'EXTRA EVAL FLAGS' --only REGEX]   # another SFI beside the plan's

Every job is one `slowfast eval --threads 1 ... --json DIR/<name>.json` command. Policies that
continue a shared dense prefill (full, streaming, oracle, oracle-sfi fork from SFI's prefill)
run in SFI's process; every other policy needs its own prefill and gets its own process.
Jobs are ordered by tier (--max-tier drops the later ones), the longest first within a tier.
`run` starts the next job whose model file exists whenever a worker is free (`--model NAME=PATH`
lets the files arrive while it runs), starts none that its cost estimate says would end after
--end-in, kills what still runs then, and skips jobs whose JSON is already in DIR (so a run can
be resumed; --done names more folders of finished JSON). With --cuda-policies those policies run
with `--device cuda` instead, every one of a cell (task kind, model, context, text, budget) in one
process (split_cuda), beside the CPU jobs of the others. scripts/compare_report.py turns DIR
into the tables and the plot.

SCALE (defaults: the scale of the run in docs/results.md):
  --contexts gemma3-270m=8192,16384 smollm2-135m=4096,8192
  --texts prose=data/texts/austen_prideprejudice.txt code=data/texts/rust_serde_json.txt
  --budgets 0.1,0.2,0.5   --oracle-budget 0.2
  --ruler-tasks gemma3-270m=...  smollm2-135m=...   --ruler-samples 3 --ruler-samples-other 1 --ruler-samples-high 1
  --nll-tokens 512  --agree-tokens 64  --passkey-trials 3
Texts: scripts/get_texts.sh (prose), scripts/get_code_text.sh (code).
"""
import argparse
import os
import re
import shlex
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
# Models whose trained context is the higher context: passkey's prompt leaves room there for its
# answer (PASSKEY_ANSWER tokens), so its cell `8192` runs a prompt of 8184.
MAX_CONTEXT = {"smollm2-135m": 8192}
PASSKEY_ANSWER = 8
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
    def __init__(self, tier, name, model, argv, cost, device="cpu"):
        self.tier, self.name, self.model, self.argv, self.cost = tier, name, model, argv, cost
        self.device = device

    def cmd(self, binary, out, model_path):
        a = [binary, "eval", "-m", model_path.get(self.model, self.model), "--threads", "1"]
        if self.device == "cuda":
            a += ["--device", "cuda"]
        a += self.argv + ["--json", os.path.join(out, self.name + ".json")]
        return a

    def policies(self):
        return self.argv[self.argv.index("--policies") + 1].split(",")

    def with_policies(self, pols):
        argv = list(self.argv)
        argv[argv.index("--policies") + 1] = ",".join(pols)
        return argv


def split_cuda(jobs, cuda, done):
    """Moves the policies in `cuda` off the CPU jobs not yet `done` (names whose JSON exists) onto
    GPU jobs, one per task kind, model, context, text and budget: every moved policy of that
    cell (and full KV, the GPU's own reference for Δnll and agreement) and, for RULER, every
    moved task, in one `--device cuda` process named cuda-<the CPU job's name without its task
    and group>. The CPU jobs keep their names and lose those policies (a job left with none
    goes); an agreement job splits into agree-<...>-<first policy> ones. Done jobs stay as they
    are, so the runner skips them. A cell's GPU process runs every moved policy on every moved
    task, so in a cell that is partly done it repeats some pairs (the report shows them as `†`
    rows beside the CPU's)."""
    cpu, cells = [], {}
    for j in jobs:
        if j.name in done:
            cpu.append(j)
            continue
        pols = j.policies()
        moved = [p for p in pols if p in cuda]
        kept = [p for p in pols if p not in cuda]
        if moved:
            kind = j.name.split("-")[0]
            a = j.argv
            b = a[a.index("--kv-budget") + 1]
            # names go on <kind>-<model>-<ctx>-<text>-... (passkey's without the text; its
            # --context can be shorter than the cell's, see MAX_CONTEXT)
            ctx, text = (j.name[len(f"{kind}-{j.model}-"):].split("-") + [""])[:2]
            text = "" if kind == "passkey" else "-" + text
            key = f"cuda-{kind}-{j.model}-{ctx}{text}-{b}"
            c = cells.setdefault(key, {"job": j, "pols": [], "tasks": [], "tier": j.tier, "cost": 0.0})
            c["pols"] += [p for p in moved if p not in c["pols"]]
            if kind == "ruler":
                t = a[a.index("--ruler-tasks") + 1]
                if t not in c["tasks"]:
                    c["tasks"].append(t)
            c["tier"] = min(c["tier"], j.tier)
            c["cost"] += j.cost / 20  # the GPU's prefill is seconds, not minutes
        if kept and j.name.startswith("agree-"):
            # one process per policy with a prefill of its own (each prefills twice, for the
            # greedy and the teacher-forced pass, beside full KV's one), so that no single job
            # holds five long prefills; the prefill-free ones share full KV's
            P = j.cost / 8
            own = [p for p in kept if p in OWN_PREFILL]
            free = [p for p in kept if p not in OWN_PREFILL]
            for part in [[p] for p in own] + ([free] if free else []):
                cpu.append(Job(j.tier, f"{j.name}-{part[0]}", j.model, j.with_policies(part),
                               P * (1 + 2 * len([p for p in part if p in OWN_PREFILL]))))
        elif kept:
            cpu.append(Job(j.tier, j.name, j.model, j.with_policies(kept),
                           j.cost * max(len(kept), 1) / len(pols)))
    gpu = []
    for key, c in cells.items():
        j = c["job"]
        pols = ["full"] + [p for p in c["pols"] if p != "full"]
        argv = j.with_policies(pols)
        if c["tasks"]:
            argv[argv.index("--ruler-tasks") + 1] = ",".join(c["tasks"])
        gpu.append(Job(c["tier"], key, j.model, argv, c["cost"], device="cuda"))
    return cpu + gpu


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
                    pk_ctx = min(ctx, MAX_CONTEXT.get(m, ctx + PASSKEY_ANSWER) - PASSKEY_ANSWER)
                    argv = ["--task", "passkey", "-i", list(texts.values())[0], "--context",
                            str(pk_ctx), "--passkey-trials", str(a.passkey_trials),
                            "--passkey-depths", "0.1,0.5,0.9", "--seed", "1",
                            "--policies", ",".join(g), "--kv-budget", str(b)]
                    cost = a.passkey_trials * (P + len(g) * 8 * D)
                    add(tier, f"passkey-{m}-{ctx}-{b}-{g[0]}", m, argv, cost)
    jobs = [j for j in jobs if j.tier <= a.max_tier]
    if a.sfi_variant is not None:
        jobs = sfi_variant(jobs, shlex.split(a.sfi_variant))
    if a.cuda_policies:
        jobs = split_cuda(jobs, set(a.cuda_policies.split(",")), done_names(a))
    if a.only:
        jobs = [j for j in jobs if re.search(a.only, j.name)]
    jobs.sort(key=lambda j: (j.tier, -j.cost))
    return jobs


def sfi_variant(jobs, extra):
    """The plan's SFI alone, with `extra` flags (another SFI to compare beside the plan's): each
    job that runs sfi keeps its name and runs sfi only (agreement brings full KV, its reference,
    by itself); the others go. Its results go to their own --out, which compare_report.py reads
    with --variant LABEL=DIR."""
    return [Job(j.tier, j.name, j.model, j.with_policies(["sfi"]) + extra, j.cost)
            for j in jobs if "sfi" in j.policies()]


def done_names(a):
    """Jobs whose JSON is in --out or a --done folder."""
    return {f[:-5] for d in [a.out] + a.done if os.path.isdir(d) for f in os.listdir(d)
            if f.endswith(".json")}


def run(a, jobs):
    os.makedirs(a.out, exist_ok=True)
    logs = os.path.join(a.out, "logs")
    os.makedirs(logs, exist_ok=True)
    model_path = dict(x.split("=", 1) for x in a.model)
    t0 = time.time()
    end = t0 + a.end_in if a.end_in else None
    done = done_names(a)
    pending = [j for j in jobs if j.name not in done]
    running = {}  # pid -> (job, Popen, start)
    ratios = {"cpu": [], "cuda": []}  # measured / estimated seconds of finished jobs
    slots = {"cpu": a.workers, "cuda": a.gpu_workers}
    state = open(os.path.join(a.out, "runner.log"), "a")

    def log(msg):
        state.write(f"{time.time() - t0:8.1f} {msg}\n")
        state.flush()

    def ready(j):
        p = model_path.get(j.model)
        return p is None or os.path.exists(p)

    def ratio(dev):
        r = sorted(ratios[dev])
        return r[len(r) // 2] if r else 1.0

    def fits(j, now):  # a worker of its device exists and, with a deadline, it ends before it
        return slots[j.device] > 0 and (not end or now + j.cost * ratio(j.device) * 1.15 < end)

    log(f"start: {len(pending)} jobs, {a.workers} CPU and {a.gpu_workers} GPU workers, "
        f"end in {a.end_in}")
    stop_file = os.path.join(a.out, "STOP")
    while pending or running:
        for pid, (j, pr, st) in list(running.items()):
            rc = pr.poll()
            if rc is not None:
                del running[pid]
                secs = time.time() - st
                if rc == 0:
                    ratios[j.device].append(secs / j.cost)
                log(f"done rc={rc} {secs:.0f}s (est {j.cost:.0f}) {j.name}")
        now = time.time()
        if end and now > end:
            for pid, (j, pr, st) in running.items():
                pr.kill()
                log(f"killed at the end: {j.name}")
            break
        for dev, n in slots.items():
            while sum(1 for j, _, _ in running.values() if j.device == dev) < n \
                    and not os.path.exists(stop_file):
                cand = [j for j in pending if j.device == dev and ready(j) and fits(j, now)]
                if not cand:
                    break
                j = cand[0]
                pending.remove(j)
                err = open(os.path.join(logs, j.name + ".err"), "w")
                pr = subprocess.Popen(j.cmd(a.bin, a.out, model_path), stdout=subprocess.DEVNULL,
                                      stderr=err, env=dict(os.environ, RAYON_NUM_THREADS="1"))
                running[pr.pid] = (j, pr, time.time())
                log(f"start ({dev}, tier {j.tier}, est {j.cost * ratio(dev):.0f}s) {j.name}")
        if not running and pending:
            if not any(ready(j) for j in pending):
                time.sleep(2)
                continue
            if os.path.exists(stop_file):
                break
            if not [j for j in pending if ready(j) and fits(j, time.time())]:
                log(f"nothing more fits: {len(pending)} jobs left")
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
    ap.add_argument("--done", nargs="*", default=[],
                    help="folders of earlier results: a job whose JSON is there counts as run")
    ap.add_argument("--cuda-policies", default="",
                    help="policies to run with --device cuda, grouped per cell (e.g. full,sfi,"
                    "streaming,snapkv,pyramidkv,quest); the rest stay single-thread CPU jobs")
    ap.add_argument("--only", help="a regular expression: the jobs whose names it matches (re.search)")
    ap.add_argument("--sfi-variant", metavar="ARGS",
                    help="run only the plan's SFI jobs, each with these extra eval flags (e.g. "
                         "'--sfi-candidates 2 --sfi-trigger periodic --sfi-refresh-interval 6'), "
                         "into their own --out")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="CPU jobs at a time")
    ap.add_argument("--gpu-workers", type=int, default=2, help="--device cuda jobs at a time")
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
