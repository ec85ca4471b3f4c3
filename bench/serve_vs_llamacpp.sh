#!/usr/bin/env bash
# The same load against `slowfast serve` and llama.cpp's server (llama-cpp-python's
# `python3 -m llama_cpp.server`) on the same GGUF, one after the other in one run, on the CPU.
#
#   bench/serve_vs_llamacpp.sh [--concurrency C] [--requests R] [--max-tokens T]
#       [--prompt-lengths 16,128,512] [--max-batch B] [--out DIR]
#
# Writes DIR/slowfast.json and DIR/llamacpp.json (bench/serve_load.py's records) and prints
# both tables. Needs `pip install "llama-cpp-python[server]"` (installed when missing) and the
# default model (`slowfast fetch`). Environment: SLOWFAST_BIN (target/release/slowfast).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${SLOWFAST_BIN:-$repo/target/release/slowfast}"
concurrency=64
requests=64
max_tokens=32
lengths="16,128,512"
max_batch=16
out="$(mktemp -d)"
while [ $# -gt 0 ]; do
    case "$1" in
        --concurrency) concurrency="$2"; shift 2 ;;
        --requests) requests="$2"; shift 2 ;;
        --max-tokens) max_tokens="$2"; shift 2 ;;
        --prompt-lengths) lengths="$2"; shift 2 ;;
        --max-batch) max_batch="$2"; shift 2 ;;
        --out) out="$2"; mkdir -p "$out"; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "serve_vs_llamacpp.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
python3 -c "import llama_cpp.server" 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check "llama-cpp-python[server]"
gguf="$("$bin" fetch gemma3-270m 2>/dev/null | tail -1)"
[ -f "$gguf" ] || { echo "cannot find the default model ($gguf)" >&2; exit 1; }
threads="$(nproc)"
load=(python3 "$repo/bench/serve_load.py" --concurrency "$concurrency" --requests "$requests"
      --max-tokens "$max_tokens" --prompt-lengths "$lengths" --ignore-eos
      --disconnect-fraction 0.25 --seed 1)
pids=()
cleanup() { for p in "${pids[@]+"${pids[@]}"}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_health() { # url
    for _ in $(seq 1 240); do
        curl -sf "$1" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    echo "no answer from $1" >&2
    return 1
}

echo "== slowfast serve ($gguf, --max-batch $max_batch, $threads threads)"
log="$out/slowfast.log"
"$bin" serve -m "$gguf" --port 0 --max-batch "$max_batch" --max-queue 1024 \
    --max-context 2048 --threads "$threads" 2>"$log" &
pids+=($!)
port=""
for _ in $(seq 1 240); do
    port="$(grep -o 'listening on http://[^ ]*' "$log" | sed 's/.*://' || true)"
    [ -n "$port" ] && break
    sleep 0.5
done
[ -n "$port" ] || { cat "$log"; exit 1; }
wait_health "http://127.0.0.1:$port/health"
"${load[@]}" --url "http://127.0.0.1:$port" --json "$out/slowfast.json"
kill "${pids[0]}"; wait "${pids[0]}" 2>/dev/null || true

echo "== llama.cpp server (llama-cpp-python, --n_threads $threads)"
lport=$((port + 1))
python3 -m llama_cpp.server --model "$gguf" --n_ctx 8192 --n_threads "$threads" \
    --n_threads_batch "$threads" --port "$lport" --interrupt_requests False \
    >"$out/llamacpp.log" 2>&1 &
pids+=($!)
wait_health "http://127.0.0.1:$lport/v1/models"
"${load[@]}" --url "http://127.0.0.1:$lport" --openai-compat-only --json "$out/llamacpp.json"
echo "records in $out"
