#!/usr/bin/env bash
# Builds the slowfast-cuda GPU test binaries and the micro-benchmark here (no GPU or CUDA
# toolkit needed), copies them to .bin/ (git-ignored), and prints the `run`-tool command that
# runs them on the GPU machine with SLOWFAST_REQUIRE_GPU=1, writing logs to $OUT.
#
#   scripts/gpu_test.sh            # build + print the command
#   CARGO_MANIFEST=path/Cargo.toml scripts/gpu_test.sh   # build through another workspace root
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
manifest="${CARGO_MANIFEST:-$root/Cargo.toml}"
mkdir -p .bin
rm -f .bin/slowfast_cuda-* .bin/cuda_bench

# build MODE ARGS...: MODE "test" lists test executables, "bin" lists the others.
build() {
  local mode="$1"
  shift
  cargo "$@" --manifest-path "$manifest" -p slowfast-cuda --features cuda --release --message-format=json \
    | python3 -c '
import json, sys
want_test = sys.argv[1] == "test"
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-message" and m["message"].get("level") == "error":
        sys.stderr.write(m["message"]["rendered"])
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] == want_test:
        print(m["executable"])
' "$mode"
}

# test binaries: one per tests/*.rs target (and the lib's unit tests)
for exe in $(build test test --no-run); do
  name="$(basename "$exe")"
  cp "$exe" ".bin/slowfast_cuda-${name%-*}"
done
for exe in $(build bin build --example cuda_bench); do
  cp "$exe" .bin/cuda_bench
done
ls -la .bin/ | grep -E "slowfast_cuda|cuda_bench" >&2

cat <<'CMD'
# run tool, carry [".bin"], timeout_s 600:
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 SLOWFAST_REQUIRE_GPU=1 SLOWFAST_REQUIRE_NVRTC=1; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/nvidia-smi.txt 2>&1; rc=0; for t in .bin/slowfast_cuda-*; do echo "== $t" | tee -a $OUT/tests.log; $t --test-threads=1 --nocapture 2>&1 | tee -a $OUT/tests.log; [ "${PIPESTATUS[0]}" = 0 ] || rc=1; done; .bin/cuda_bench 2>&1 | tee $OUT/bench.log; echo "tests rc=$rc"
CMD
