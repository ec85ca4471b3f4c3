#!/usr/bin/env bash
# The `slowfast serve` checks, as CI runs them: installs what they need (pip: openai pytest
# requests httpx jsonschema playwright; apt: nginx chromium), builds the release binary, fetches
# the default model, then runs
#   1. python3 -m pytest -q tests/serve            (the OpenAI-compatible API against its contract,
#      and tests/serve/test_faults.py: client faults against servers of its own, ~25 s; the
#      playground's test runs in step 6)
#   2. scripts/serve_nginx.sh --check              (2 replicas behind nginx, 16 concurrent, 32 requests)
#   3. bench/serve_load.py straight against one server (64 concurrent streams, a quarter of the
#      clients disconnecting mid-stream)
#   4. tests/serve/schemathesis.sh                (schemathesis against GET /openapi.json: no 5xx,
#      every response as described; it pip-installs schemathesis if missing)
#   5. tests/serve/fault_storm.py --url            (the fault storm as the GPU `faults` phase runs
#      it, against one server)
#   6. tests/serve/test_playground.py              (the playground page at / in headless Chromium
#      driven by Playwright: streamed answer, policy switch, the pass key SFI's memory kept and
#      StreamingLLM's lost; ~45 s; screenshots in $PLAYGROUND_SCREENSHOT_DIR, default a temp dir)
# each bounded in time. All six run; the exit status is non-zero when any failed.
#
# Environment: SLOWFAST_BIN (default target/release/slowfast; set it to skip the build),
# SLOWFAST_SERVE_MODEL (default gemma3-270m), SERVE_TEST_TIMEOUT (s, pytest; default 900),
# SERVE_LOAD_TIMEOUT (s, each load run; default 600), SERVE_LOAD_JSON_DIR (keep the load reports),
# SERVE_FUZZ_TIMEOUT (s, schemathesis; default 420), SERVE_FAULT_TIMEOUT (s, the storm; default 240),
# SERVE_PLAYGROUND_TIMEOUT (s, the browser test; default 300).
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"

model="${SLOWFAST_SERVE_MODEL:-gemma3-270m}"
export SLOWFAST_SERVE_MODEL="$model"
test_timeout="${SERVE_TEST_TIMEOUT:-900}"
load_timeout="${SERVE_LOAD_TIMEOUT:-600}"
fuzz_timeout="${SERVE_FUZZ_TIMEOUT:-420}"
fault_timeout="${SERVE_FAULT_TIMEOUT:-240}"
playground_timeout="${SERVE_PLAYGROUND_TIMEOUT:-300}"
json_dir="${SERVE_LOAD_JSON_DIR:-$(mktemp -d)}"
mkdir -p "$json_dir"

echo "== dependencies"
missing=()
for m in openai pytest requests httpx jsonschema playwright; do
    python3 -c "import $m" 2>/dev/null || missing+=("$m")
done
if [ "${#missing[@]}" -gt 0 ]; then
    python3 -m pip install -q --disable-pip-version-check "${missing[@]}" || { echo "pip install ${missing[*]} failed" >&2; exit 1; }
fi
apt_missing=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || apt_missing+=(nginx)
# The playground's browser: Debian's chromium, driven by Playwright (its own browser download
# is not needed: the test launches this one).
command -v chromium >/dev/null 2>&1 || [ -n "${CHROMIUM:-}" ] || apt_missing+=(chromium)
if [ "${#apt_missing[@]}" -gt 0 ]; then
    sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_="sudo"
    $sudo_ apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq "${apt_missing[@]}" >/dev/null \
        || { echo "apt-get install ${apt_missing[*]} failed" >&2; exit 1; }
fi

if [ -z "${SLOWFAST_BIN:-}" ]; then
    echo "== building target/release/slowfast"
    cargo build --release -q -p slowfast || exit 1
    export SLOWFAST_BIN="$repo/target/release/slowfast"
fi
"$SLOWFAST_BIN" serve --help >/dev/null || { echo "$SLOWFAST_BIN has no working 'serve' command" >&2; exit 1; }
if [ "$model" = gemma3-270m ]; then
    echo "== fetching the default model (cached after the first run)"
    "$SLOWFAST_BIN" fetch gemma3-270m || exit 1
fi

failed=()

echo "== 1/6 pytest tests/serve"
timeout -k 10 "$test_timeout" python3 -m pytest -q -p no:cacheprovider tests/serve \
    --ignore=tests/serve/test_playground.py || failed+=("pytest tests/serve")

echo "== 2/6 two replicas behind nginx"
timeout -k 10 "$load_timeout" scripts/serve_nginx.sh --check --replicas 2 --concurrency 16 --requests 32 \
    --max-tokens 16 --load-arg --json --load-arg "$json_dir/nginx.json" || failed+=("serve_nginx.sh --check")

echo "== 3/6 load straight against one server"
# against_server TIMEOUT SERVE_FLAGS -- COMMAND...: COMMAND with --url URL appended, against a
# fresh server started with SERVE_FLAGS.
against_server() (  # a subshell: its EXIT trap stops the server
    url="" rc=0
    log="$(mktemp)"
    limit="$1"; shift
    flags=()
    while [ "$1" != -- ]; do flags+=("$1"); shift; done
    shift
    "$SLOWFAST_BIN" serve --model "$model" --host 127.0.0.1 --port 0 "${flags[@]}" >"$log" 2>&1 </dev/null &
    pid=$!
    # shellcheck disable=SC2064
    trap "kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f '$log'" EXIT
    deadline=$(( $(date +%s) + 180 ))
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
    timeout -k 10 "$limit" "$@" --url "$url" || rc=$?
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "the server died during the load run:" >&2; tail -n 30 "$log" >&2; rc=1
    elif [ "$rc" -ne 0 ]; then
        tail -n 30 "$log" >&2
    fi
    exit "$rc"
)
against_server "$load_timeout" -- python3 bench/serve_load.py --concurrency 64 --requests 64 \
    --max-tokens 16 --prompt-lengths 16,64,256 --ignore-eos --disconnect-fraction 0.25 \
    --json "$json_dir/direct.json" || failed+=("serve_load.py against one server")

echo "== 4/6 schemathesis against /openapi.json"
timeout -k 10 "$fuzz_timeout" tests/serve/schemathesis.sh || failed+=("tests/serve/schemathesis.sh")

echo "== 5/6 the fault storm against one server (--url)"
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
against_server "$fault_timeout" --max-context 1024 --max-body-bytes 65536 --header-read-timeout 1.5 \
    --body-read-timeout 2 -- python3 tests/serve/fault_storm.py --max-body-bytes 65536 \
    --header-read-timeout 1.5 --body-read-timeout 2 || failed+=("fault_storm.py against one server")

echo "== 6/6 the playground in headless Chromium"
SLOWFAST_PLAYGROUND_REQUIRED=1 timeout -k 10 "$playground_timeout" python3 -m pytest -q -s -p no:cacheprovider \
    tests/serve/test_playground.py || failed+=("tests/serve/test_playground.py")

echo "load reports: $json_dir"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "all serve checks passed"
