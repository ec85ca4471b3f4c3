"""Tests of the policy comparison's scripts (scripts/compare_policies.py, scripts/compare_report.py):
the GPU/CPU split loses and duplicates no (job, policy), and the report reads both kinds of file.

    python3 -m unittest discover -s tests/scripts -v
"""
import contextlib
import importlib.util
import io
import json
import os
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", name + ".py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


cp = module("compare_policies")
cr = module("compare_report")
GPU_POLICIES = "full,sfi,streaming,snapkv,pyramidkv,quest"


def plan(argv):
    """The jobs `compare_policies.py jobs ARGV` would list."""
    got = []
    make = cp.make_jobs
    cp.make_jobs = lambda a: got.append(make(a)) or []
    old = sys.argv
    sys.argv = ["compare_policies.py", "jobs"] + argv
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            cp.main()
    finally:
        sys.argv, cp.make_jobs = old, make
    return got[0]


def arg(job, flag):
    return job.argv[job.argv.index(flag) + 1]


def cell(job):
    """(kind, model, context name, text, budget, task) of a CPU-plan job or a cuda job's cell."""
    name = job.name[5:] if job.name.startswith("cuda-") else job.name
    kind = name.split("-")[0]
    ctx, text = (name[len(f"{kind}-{job.model}-"):].split("-") + [""])[:2]
    return kind, job.model, ctx, "" if kind == "passkey" else text, arg(job, "--kv-budget")


class SplitCuda(unittest.TestCase):
    def setUp(self):
        self.out = tempfile.mkdtemp()
        self.cpu_plan = plan(["--out", self.out])
        self.split = plan(["--out", self.out, "--cuda-policies", GPU_POLICIES])

    def pairs(self, jobs, on_gpu):
        """Every (cell, task, policy) a list of jobs runs on one device; full KV only where it
        is the CPU plan's own job (a cuda job adds it as its reference)."""
        out = []
        for j in jobs:
            if (j.device == "cuda") != on_gpu:
                continue
            tasks = arg(j, "--ruler-tasks").split(",") if "--ruler-tasks" in j.argv else [""]
            for p in j.policies():
                if on_gpu and p == "full":
                    continue
                out += [(cell(j), t, p) for t in tasks]
        return out

    def test_every_policy_runs_once_on_one_device(self):
        want = sorted(self.pairs(self.cpu_plan, False))
        cuda = set(GPU_POLICIES.split(","))
        got_cpu = self.pairs(self.split, False)
        got_gpu = self.pairs(self.split, True)
        self.assertFalse([x for x in got_cpu if x[2] in cuda], "a GPU policy left on the CPU")
        self.assertEqual(len(got_gpu), len(set(got_gpu)), "a (cell, task, policy) twice on the GPU")
        # full KV runs on the GPU as each cell's reference: its CPU-plan jobs are covered there
        want_no_gpu_full = [x for x in want if not (x[2] == "full")]
        self.assertEqual(sorted(got_cpu + got_gpu), want_no_gpu_full)

    def test_cuda_jobs_run_full_first_on_the_device(self):
        gpu = [j for j in self.split if j.device == "cuda"]
        self.assertTrue(gpu)
        for j in gpu:
            self.assertEqual(j.policies()[0], "full", j.name)
            cmd = j.cmd("slowfast", self.out, {})
            self.assertEqual(cmd[cmd.index("--device") + 1], "cuda")
            self.assertTrue(j.name.startswith("cuda-"))

    def test_agreement_splits_per_prefilling_policy(self):
        cpu_agree = [j for j in self.split if j.device == "cpu" and j.name.startswith("agree-")]
        for j in cpu_agree:
            own = [p for p in j.policies() if p in cp.OWN_PREFILL]
            self.assertLessEqual(len(own), 1, j.name)

    def test_done_jobs_stay_whole_and_move_nothing(self):
        done = self.cpu_plan[0]
        with open(os.path.join(self.out, done.name + ".json"), "w") as f:
            f.write("[]")
        split = plan(["--out", self.out, "--cuda-policies", GPU_POLICIES])
        kept = [j for j in split if j.name == done.name]
        self.assertEqual(len(kept), 1)
        self.assertEqual(kept[0].policies(), done.policies())
        # the other jobs' pairs are all still covered, on one device or the other
        rest = [j for j in self.cpu_plan if j.name != done.name]
        got = set(self.pairs(split, False)) | set(self.pairs(split, True))
        self.assertFalse([x for x in self.pairs(rest, False) if x[2] != "full" and x not in got])

    def test_passkey_leaves_room_for_its_answer_at_the_models_context(self):
        pk = [j for j in self.split if "passkey-smollm2-135m-8192" in j.name]
        self.assertTrue(pk)
        for j in pk:
            self.assertEqual(arg(j, "--context"), str(8192 - cp.PASSKEY_ANSWER), j.name)
        gemma = [j for j in self.split if "passkey-gemma3-270m-16384" in j.name]
        self.assertTrue(all(arg(j, "--context") == "16384" for j in gemma))


class SfiVariant(unittest.TestCase):
    def test_every_sfi_job_of_the_plan_runs_sfi_alone_with_the_flags(self):
        out = tempfile.mkdtemp()
        full = plan(["--out", out])
        extra = "--sfi-candidates 2 --sfi-trigger periodic"
        got = plan(["--out", out, "--sfi-variant", extra])
        want = sorted(j.name for j in full if "sfi" in j.policies())
        self.assertEqual(sorted(j.name for j in got), want)
        for j in got:
            self.assertEqual(j.policies(), ["sfi"], j.name)
            self.assertEqual(j.argv[-4:], extra.split(), j.name)


class Report(unittest.TestCase):
    def write(self, d, name, recs):
        with open(os.path.join(d, name + ".json"), "w") as f:
            json.dump(recs, f)

    def test_gpu_rows_take_their_delta_from_the_gpus_full_kv(self):
        d = tempfile.mkdtemp()
        rec = {"retained_fraction": 0.2}
        self.write(d, "nll-gemma3-270m-8192-prose-0.2-full", [dict(rec, policy="full", nll=3.0)])
        self.write(d, "nll-gemma3-270m-8192-prose-0.1-h2o", [dict(rec, policy="h2o", nll=3.5)])
        self.write(d, "cuda-nll-gemma3-270m-8192-prose-0.1", [
            dict(rec, policy="full", nll=2.9), dict(rec, policy="sfi", nll=3.1)])
        ruler, nll, agree, passkey = cr.load([d])
        t = cr.other_table(nll, agree, passkey, "gemma3-270m", 8192)
        rows = {line.split("|")[1].strip() + "@" + line.split("|")[2].strip(): line
                for line in t.splitlines()[2:]}
        self.assertIn("+0.5000", rows["h2o@0.1"])  # against the CPU's full KV
        self.assertIn("+0.2000", rows["sfi" + cr.GPU + "@0.1"])  # against the GPU's
        self.assertIn("full" + cr.GPU + "@–", rows)

    def test_cuda_ruler_file_holds_every_task_of_its_cell(self):
        d = tempfile.mkdtemp()
        task = lambda t, s: {"task": t, "score": s, "samples": 1, "answers": [{"score": s}]}
        recs = [{"policy": p, "retained_fraction": 0.2,
                 "tasks": [task("niah_single_2", 100.0), task("niah_multikey_1", s)]}
                for p, s in (("full", 100.0), ("sfi", 0.0))]
        self.write(d, "cuda-ruler-smollm2-135m-4096-code-0.1", recs)
        ruler, *_ = cr.load([d])
        _, avgs = cr.ruler_table(ruler, "smollm2-135m", 4096, "code")
        self.assertEqual(avgs[("full" + cr.GPU, None)], 100.0)
        self.assertEqual(avgs[("sfi" + cr.GPU, 0.1)], 50.0)

    def test_a_variant_takes_its_delta_from_its_own_full_kv(self):
        base, var = tempfile.mkdtemp(), tempfile.mkdtemp()
        rec = {"retained_fraction": 0.2}
        self.write(base, "nll-gemma3-270m-8192-code-0.2-full", [dict(rec, policy="full", nll=1.0)])
        self.write(base, "nll-gemma3-270m-8192-code-0.2-sfi", [dict(rec, policy="sfi", nll=1.25)])
        self.write(base, "nll-gemma3-270m-8192-code-0.2-quest", [dict(rec, policy="quest", nll=1.2)])
        self.write(var, "nll-gemma3-270m-8192-code-0.2-sfi", [dict(rec, policy="sfi", nll=1.05)])
        self.write(var, "nll-gemma3-270m-8192-code-0.2-full", [dict(rec, policy="full", nll=0.99)])
        order = list(cr.ORDER)
        try:
            ruler, nll, agree, passkey = cr.load([base])
            self.assertEqual(cr.add_variant(f"new={var}", ruler, nll, agree, passkey), "new")
            self.assertEqual(cr.ORDER[:3], ["full", "sfi", "new"])
            # Against the variant machine's full KV (0.99), not the plan's (1.0).
            self.assertAlmostEqual(cr.delta(nll, "gemma3-270m", 8192, "code", 0.2, "new"), 0.06)
            self.assertAlmostEqual(cr.delta(nll, "gemma3-270m", 8192, "code", 0.2, "sfi"), 0.25)
            t = cr.targets(ruler, nll, {"gemma3-270m": [8192]}, "new")
            row = [r for r in t.splitlines() if "| 0.2 |" in r][0]
            self.assertIn("+0.0600", row)
            self.assertIn("+0.2000 (quest)", row)  # today's SFI is not among the others
            with self.assertRaises(SystemExit):
                cr.add_variant(f"new={var}", ruler, nll, agree, passkey)
        finally:
            cr.ORDER[:] = order

    def test_an_unknown_cuda_file_is_refused(self):
        d = tempfile.mkdtemp()
        self.write(d, "cuda-bogus-gemma3-270m-8192", [{"policy": "full"}])
        with self.assertRaises(SystemExit):
            cr.load([d])


if __name__ == "__main__":
    unittest.main()
