# Sourced by the GPU machine's scripts (gpu_run.sh, gpu_spec.sh; gpu_test.sh copies it to .bin/):
#   url="$(serve_url LOG PID [SECONDS])"
# waits for `slowfast serve` (process PID, output in LOG) to print its "listening on" line and
# prints the URL; prints nothing if the process exits first or SECONDS (default 120) pass.
serve_url() {
  local log="$1" pid="$2" tries=$(( ${3:-120} * 5 )) url=""
  for _ in $(seq 1 "$tries"); do
    url="$(grep -o 'listening on http://[^[:space:]]*' "$log" 2>/dev/null | head -n 1 | sed 's/^listening on //')"
    [ -n "$url" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  printf '%s' "$url"
}
