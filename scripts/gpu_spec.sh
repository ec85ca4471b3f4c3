#!/usr/bin/env bash
# Speculative decoding on the GPU machine (issue 20), from .bin/ (scripts/gpu_test.sh copies
# this script there). Phases, in order when several are given:
#   tests   the verification kernel against its f64 reference (gpu_attention), verification
#           rows against decode steps and, with the default model, 256 greedy tokens of each
#           drafter against full KV at 8K (gpu_speculative)
#   accept  the default model end to end: `generate --device cuda` at 4K / 8K / 16K of Emma,
#           256 greedy tokens, full KV and every drafter at γ 2 / 4 / 6 / 8 (--json each);
#           accept.json (accepted-length histograms summed over the contexts) and accept.md
#   bench   `bench --device cuda --model random:qwen3-4b --speculate sfi,streaming,ngram` at
#           CTX (8k,32k,128k), batch 1 and SB (6), replaying accept.json (alpha:0.9 without it);
#           then sfi refreshing on the trigger
#   graphs  bench's points at γ 4 and 8 with --spec-graphs off (verifications kernel by kernel)
#   serve   `serve --device cuda` on the default model, SB (6) streams of 256 greedy tokens
#           after ~SPL (6000) tokens of Emma each (bench/serve_load.py --prompt-file): plain
#           full KV, then `--speculate` sfi (every / trigger + adaptive γ), streaming, ngram
# The default model: /tmp/gemma-3-270m-q4_k_m.gguf, joined from /tmp/carry/m1..m6 when absent
# (scripts/gpu_default_model.sh stage makes the parts; each carried in its own call).
#   bash .bin/gpu_spec.sh tests accept bench
set -uo pipefail
# From the checkout's root (the default-model test reads docs/ as its prompt); the binaries
# beside this script (BIN overrides), e.g. a copy kept in /tmp/carry while the machine is warm.
[ -f docs/results.md ] || cd "$(dirname "$0")/.."
B="${BIN:-$(cd "$(dirname "$0")" && pwd)}"
. "$B/serve_url.sh"  # serve_url: wait for a server's "listening on" line
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export SLOWFAST_REQUIRE_GPU=1 SLOWFAST_REQUIRE_NVRTC=1 PYTHONUNBUFFERED=1
export SLOWFAST_FIXTURES="$B/fixtures" SLOWFAST_HOME="${SLOWFAST_HOME:-/tmp/slowfast-home}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
M=/tmp/gemma-3-270m-q4_k_m.gguf
if [ ! -f "$M" ] && [ -f /tmp/carry/m6 ]; then
  cat /tmp/carry/m1 /tmp/carry/m2 /tmp/carry/m3 /tmp/carry/m4 /tmp/carry/m5 /tmp/carry/m6 > $M
  echo "$(cat $B/model.sha256)  $M" | sha256sum -c - || { rm -f $M; echo "model parts corrupt" >&2; }
fi
SFI_OPTS="--kv-budget ${BUDGET:-2048} --sfi-refresh-interval ${RI:-32}"
rc=0
phases="${*:-tests accept bench}"
for p in $phases; do
  case "$p" in
    tests)
      $B/slowfast_cuda-gpu_attention --test-threads=1 --nocapture verify 2>&1 | tee -a "$OUT/spec-tests.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      [ -f "$M" ] && export SLOWFAST_DEFAULT_MODEL=$M
      $B/slowfast_engine-gpu_speculative --test-threads=1 --nocapture 2>&1 | tee -a "$OUT/spec-tests.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    accept)
      [ -f "$M" ] || { echo "accept: no default model at $M" >&2; rc=1; continue; }
      for ctx in ${ACTX:-4096 8192 16384}; do
        # about 3.6 bytes a token in Emma; past the front matter
        tail -c +60000 $B/texts/austen_emma.txt | head -c $((ctx * 36 / 10)) > /tmp/prompt-$ctx.txt
        $B/slowfast generate --device cuda -m $M --prompt-file /tmp/prompt-$ctx.txt -n 256 --temperature 0 \
          --ignore-eos --json > "$OUT/gen-full-$ctx.json" 2> "$OUT/gen-full-$ctx.err" || rc=1
        for d in sfi streaming ngram; do
          for g in 2 4 6 8; do
            $B/slowfast generate --device cuda -m $M --prompt-file /tmp/prompt-$ctx.txt -n 256 --temperature 0 \
              --ignore-eos --speculate $d --spec-tokens $g --kv-budget 0.2 --json \
              > "$OUT/gen-$d-$g-$ctx.json" 2> "$OUT/gen-$d-$g-$ctx.err" || rc=1
          done
        done
      done
      # passkey prompts (eval --speculate: the answers are full KV's; the acceptance is the point)
      for d in sfi streaming ngram; do
        for g in 2 4 8; do
          $B/slowfast eval --device cuda -m $M --task passkey -i $B/texts/austen_emma.txt --context 8192 \
            --passkey-trials 10 --seed 1 --policies full --speculate $d --spec-tokens $g --kv-budget 0.2 \
            --passkey-answer-tokens 16 --json "$OUT/pk-spec-$d-$g.json" > "$OUT/pk-spec-$d-$g.md" 2> "$OUT/pk-spec-$d-$g.err" || rc=1
          grep "speculate" "$OUT/pk-spec-$d-$g.err" | sed "s/^/passkey 8K: /"
        done
      done
      python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
hist, rows = {}, []
full = {}
for f in glob.glob(f"{out}/gen-full-*.json"):
    j = json.load(open(f))
    full[int(f.rsplit("-", 1)[1][:-5])] = j
for f in sorted(glob.glob(f"{out}/gen-*-*-*.json")):
    parts = os.path.basename(f)[4:-5].split("-")
    if parts[0] == "full":
        continue
    d, g, ctx = parts[0], int(parts[1]), int(parts[2])
    try:
        j = json.load(open(f))
    except ValueError:
        continue
    s = j["speculative"]
    h = hist.setdefault(d, {}).setdefault(str(g), [0] * (g + 1))
    for k, c in enumerate(s["accept_hist"].get(str(g), [])):
        h[k] += c
    fj = full.get(ctx, {})
    toks, ftoks = j.get("tokens", []), fj.get("tokens", [])
    same = 0
    for a, b in zip(toks, ftoks):
        if a != b:
            break
        same += 1
    rows.append((ctx, d, g, j["prompt_tokens"], s["acceptance_rate"], s["tokens_per_verification"],
                 j["decode_tok_s"], fj.get("decode_tok_s", 0.0), same, len(toks)))
json.dump(hist, open(f"{out}/accept.json", "w"), indent=1)
with open(f"{out}/accept.md", "w") as o:
    o.write("| context | prompt tokens | drafter | γ | acceptance | tokens / verification | tok/s | full KV tok/s | speedup | equal to full KV |\n|---|---|---|---|---|---|---|---|---|---|\n")
    for r in sorted(rows):
        sp = r[6] / r[7] if r[7] else 0.0
        o.write(f"| {r[0]} | {r[3]} | {r[1]} | {r[2]} | {r[4]:.3f} | {r[5]:.2f} | {r[6]:.1f} | {r[7]:.1f} | {sp:.2f}x | {r[8]}/{r[9]} |\n")
print(open(f"{out}/accept.md").read())
PY
      ;;
    bench)
      A="${SPEC_ACCEPT:-$OUT/accept.json}"
      [ -f "$A" ] || A=alpha:0.9
      for b in 1 ${SB:-6}; do
        $B/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX:-8k,32k,128k}" --batch $b \
          --new-tokens "${N:-64}" --policies full --speculate sfi,streaming,ngram --spec-tokens 2,4,6,8 \
          --spec-accept "$A" --spec-rounds "${ROUNDS:-32}" $SFI_OPTS --json "$OUT/spec-b$b.json" \
          2>&1 | tee "$OUT/spec-bench-b$b.log" || rc=1
        # SFI refreshing on its trigger (the bench's trigger: every --sfi-refresh-interval tokens)
        $B/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX:-8k,32k,128k}" --batch $b \
          --new-tokens "${N:-64}" --policies full --speculate sfi --spec-refresh trigger --spec-tokens 2,4,6,8 \
          --spec-accept "$A" --spec-rounds "${ROUNDS:-32}" $SFI_OPTS --json "$OUT/spec-trigger-b$b.json" \
          2>&1 | tee "$OUT/spec-trigger-b$b.log" || rc=1
      done ;;
    graphs)
      # bench's points at γ 4 and 8 again with the verifications launched kernel by kernel
      # (--spec-graphs off): against bench's (graphs on) in the same run, what the graphs save.
      # SFI refreshing every verification captures scores in each, so it never replays one.
      A="${SPEC_ACCEPT:-$OUT/accept.json}"
      [ -f "$A" ] || A=alpha:0.9
      for b in 1 ${SB:-6}; do
        for refresh in every trigger; do
          d=sfi,streaming,ngram; [ "$refresh" = trigger ] && d=sfi
          $B/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX:-8k,32k,128k}" --batch $b \
            --new-tokens "${N:-64}" --policies full --speculate $d --spec-refresh $refresh --spec-tokens 4,8 \
            --spec-accept "$A" --spec-rounds "${ROUNDS:-32}" $SFI_OPTS --spec-graphs off \
            --json "$OUT/spec-nographs-$refresh-b$b.json" 2>&1 | tee "$OUT/spec-nographs-$refresh-b$b.log" || rc=1
        done
      done ;;
    serve)
      [ -f "$M" ] || { echo "serve: no default model at $M" >&2; rc=1; continue; }
      tail -c +60000 $B/texts/austen_emma.txt > /tmp/emma.txt
      SB="${SB:-6}"
      SK="--kv-budget ${SBUDGET:-1200}"
      for cfg in "full|" "sfi-every-6|--speculate sfi --spec-tokens 6 $SK" \
                 "sfi-trigger-adaptive|--speculate sfi --spec-tokens adaptive --spec-refresh trigger $SK" \
                 "streaming-4|--speculate streaming --spec-tokens 4 $SK" "ngram-6|--speculate ngram --spec-tokens 6"; do
        name="${cfg%%|*}"; flags="${cfg#*|}"
        log="$OUT/servespec-$name.log"
        echo "== serve $name: $flags" | tee -a "$OUT/servespec.log"
        $B/slowfast serve --device cuda -m $M --max-batch "$SB" --max-context 12288 --port 0 $flags > "$log" 2>&1 &
        spid=$!
        url="$(serve_url "$log" "$spid")"
        if [ -z "$url" ]; then tail -20 "$log" | tee -a "$OUT/servespec.log"; rc=1; continue; fi
        python3 $B/serve_load.py --url "$url" --prompt-file /tmp/emma.txt --concurrency "$SB" --requests "$SB" \
          --max-tokens 256 --prompt-lengths "${SPL:-6000}" --ignore-eos --disconnect-fraction 0 --temperature 0 \
          --timeout 900 --settle-timeout 30 --json "$OUT/servespec-$name.json" 2>&1 | tee -a "$OUT/servespec.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        curl -s "$url/metrics" | grep -E "^slowfast_spec" | tee -a "$OUT/servespec.log"
        kill $spid; wait $spid 2>/dev/null
      done ;;
  esac
done
exit $rc
