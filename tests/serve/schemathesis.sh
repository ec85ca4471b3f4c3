#!/usr/bin/env bash
# Fuzzes `slowfast serve` against its own OpenAPI description (GET /openapi.json, the file
# crates/server/openapi.json) with schemathesis. Every response must be one the description
# lists, with its content type and schema (each event of a stream included), none may be a 5xx,
# and a body the description calls invalid must be refused.
#
# It installs schemathesis (pinned) with pip when it is missing, starts one server on a free
# loopback port (--max-context 128 --max-batch 4: max_tokens is cut to what 128 tokens leave,
# so even a request for the whole context stays short), runs schemathesis with a fixed seed
# and a bounded number of examples, then checks that the server is still up, logged no
# panic, and is idle (/metrics: no running or queued sequence, no KV bytes in use).
#
# Environment: SLOWFAST_BIN (default target/release/slowfast), SLOWFAST_SERVE_MODEL (default
# gemma3-270m), SLOWFAST_DEVICE (default cpu), SCHEMATHESIS_SEED (default 1),
# SCHEMATHESIS_MAX_EXAMPLES (fuzzed cases per operation, default 100), SCHEMATHESIS_ARGS (more
# schemathesis flags, shell words; paths in them absolute), SCHEMATHESIS_REPORT_DIR (keep the
# JUnit report there).
set -uo pipefail
cd "$(dirname "$0")/../.."
repo="$(pwd)"

pin="4.32.5"
bin="${SLOWFAST_BIN:-$repo/target/release/slowfast}"
model="${SLOWFAST_SERVE_MODEL:-gemma3-270m}"
device="${SLOWFAST_DEVICE:-cpu}"
seed="${SCHEMATHESIS_SEED:-1}"
examples="${SCHEMATHESIS_MAX_EXAMPLES:-100}"
report_dir="${SCHEMATHESIS_REPORT_DIR:-}"

if ! python3 -c 'import schemathesis' 2>/dev/null; then
    echo "== installing schemathesis==$pin"
    python3 -m pip install -q --disable-pip-version-check "schemathesis==$pin" \
        || { echo "pip install schemathesis==$pin failed" >&2; exit 1; }
fi
st=(python3 -m schemathesis.cli)
"${st[@]}" --version >/dev/null 2>&1 || st=(schemathesis)
[ -x "$bin" ] || { echo "$bin is not an executable; build it (cargo build --release -p slowfast) or set SLOWFAST_BIN" >&2; exit 1; }

log="$(mktemp)"
work="$(mktemp -d)"  # schemathesis and hypothesis keep state in the current directory: not the repo's
"$bin" serve --model "$model" --device "$device" --host 127.0.0.1 --port 0 \
    --max-context 128 --max-batch 4 >"$log" 2>&1 </dev/null &
pid=$!
# shellcheck disable=SC2064
trap "kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf '$log' '$work'" EXIT

url=""
deadline=$(( $(date +%s) + ${SLOWFAST_SERVE_START_TIMEOUT:-180} ))
while [ -z "$url" ]; do
    url="$(grep -o 'listening on http://[^[:space:]]*' "$log" | head -n 1 | sed 's/^listening on //' || true)"
    [ -n "$url" ] && break
    if ! kill -0 "$pid" 2>/dev/null || [ "$(date +%s)" -ge "$deadline" ]; then
        echo "the server did not come up:" >&2; tail -n 30 "$log" >&2; exit 1
    fi
    sleep 0.2
done
url="http://127.0.0.1:${url##*:}"
until curl -fsS -o /dev/null "$url/health"; do
    kill -0 "$pid" 2>/dev/null || { tail -n 30 "$log" >&2; exit 1; }
    sleep 0.2
done

report=()
if [ -n "$report_dir" ]; then
    mkdir -p "$report_dir"
    report_dir="$(cd "$report_dir" && pwd)"
    report=(--report junit --report-junit-path "$report_dir/schemathesis.xml")
fi
# shellcheck disable=SC2206
extra=(${SCHEMATHESIS_ARGS:-})
echo "== schemathesis $("${st[@]}" --version 2>/dev/null | awk '{print $NF}') against $url/openapi.json (seed $seed, $examples examples)"
start=$(date +%s)
rc=0
# One worker: with several, hypothesis parses lambdas' source from many threads at once, which
# CPython 3.11.7 (this machine's) can fail with "SystemError: AST constructor recursion depth
# mismatch". The operations that matter generate text, so more workers would gain little.
(cd "$work" && "${st[@]}" run "$url/openapi.json" \
    --checks not_a_server_error,response_schema_conformance,status_code_conformance,content_type_conformance,negative_data_rejection \
    --max-examples "$examples" --seed "$seed" --workers 1 \
    --request-timeout 120 --generation-database none --no-color \
    "${report[@]}" "${extra[@]}") || rc=$?
echo "schemathesis took $(( $(date +%s) - start ))s"
# Afterwards the server must be idle: no running or queued sequence, no KV bytes in use.
if kill -0 "$pid" 2>/dev/null; then
    python3 - "$url" <<'PY' || rc=1
import sys
sys.path.insert(0, "tests/serve")
from fault_storm import Target
m = Target(sys.argv[1]).wait_idle(kv_idle=0, timeout=30)
print("idle after the run: running", m["slowfast_running_sequences"], "queued",
      m["slowfast_queued_sequences"], "kv_bytes_in_use", m["slowfast_kv_bytes_in_use"])
PY
fi

if ! kill -0 "$pid" 2>/dev/null; then
    echo "the server died during the run:" >&2; tail -n 30 "$log" >&2; rc=1
elif grep -q 'panicked' "$log"; then
    echo "the server logged a panic:" >&2; grep -B2 -A5 'panicked' "$log" | head -n 40 >&2; rc=1
elif [ "$rc" -ne 0 ]; then
    tail -n 30 "$log" >&2
fi
exit "$rc"
