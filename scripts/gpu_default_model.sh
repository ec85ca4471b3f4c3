#!/usr/bin/env bash
# The default model (Gemma 3 270M Q4_K_M, carried in parts .m1-.m5) on the GPU: greedy tokens
# against the CPU, and eval nll / passkey with --device cuda (issues 5 and 6).
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export SLOWFAST_HOME=/tmp/slowfast-home
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
M=/tmp/gemma-3-270m-q4_k_m.gguf
cat .m1/p .m2/p .m3/p .m4/p .m5/p > $M
echo "$(cat .gpu/model.sha256)  $M" | sha256sum -c - || exit 3
B=.gpu/slowfast
T=.gpu/austen_prideprejudice.txt
P="It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a"
{
  echo "== cuda"; $B generate --device cuda -m $M -p "$P" -n 32 --temperature 0 --ignore-eos
  echo; echo "== cpu f32 KV"; $B generate --device cpu -m $M -p "$P" -n 32 --temperature 0 --ignore-eos --kv-dtype f32
  echo; echo "== cpu f16 KV"; $B generate --device cpu -m $M -p "$P" -n 32 --temperature 0 --ignore-eos
} > "$OUT/greedy.log" 2>&1
for d in cuda ${CPU_TOO:-}; do
  $B eval --device $d -m $M --task nll -i $T --context 8192 --policies full,sfi,streaming --kv-budget 0.2 \
    --json "$OUT/nll-$d.json" > "$OUT/nll-$d.md" 2> "$OUT/nll-$d.err"
  $B eval --device $d -m $M --task passkey -i $T --context 8192 --passkey-trials 10 --seed 1 \
    --policies full,sfi,streaming --kv-budget 0.2 --json "$OUT/pk-$d.json" > "$OUT/pk-$d.md" 2> "$OUT/pk-$d.err"
done
cat "$OUT/greedy.log"; cat "$OUT"/nll-*.md "$OUT"/pk-*.md; tail -3 "$OUT"/*.err
