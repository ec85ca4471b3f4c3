#!/usr/bin/env bash
# Builds every GPU test binary (slowfast-cuda kernels, slowfast-engine's GPU decoder against
# the CPU engine), the kernel micro-benchmark and the `slowfast` CLI with --features cuda here
# (no GPU or CUDA toolkit needed), copies them to .bin/ (git-ignored) with the test fixtures
# and bench/torch_reference.py, and prints the `run`-tool command that runs all of it on the
# GPU machine (tests with SLOWFAST_REQUIRE_GPU=1, then `slowfast bench --device cuda` and the
# PyTorch reference at the same contexts), writing logs to $OUT.
#
#   scripts/gpu_test.sh            # build + print the command
#   CARGO_MANIFEST=path/Cargo.toml scripts/gpu_test.sh   # build through another workspace root
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
manifest="${CARGO_MANIFEST:-$root/Cargo.toml}"
# The run tool sends the session's own checkout; when that is another worktree, stage there:
#   BIN_DIR=/path/to/that/checkout/.bin scripts/gpu_test.sh
bin="${BIN_DIR:-$root/.bin}"
mkdir -p "$bin"
rm -rf "$bin"/slowfast_cuda-* "$bin"/slowfast_engine-* "$bin"/cuda_bench "$bin"/slowfast "$bin"/fixtures

# build MODE ARGS...: MODE "test" lists test executables, "bin" lists the others.
build() {
  local mode="$1"
  shift
  local pkg="$1"
  shift
  cargo "$@" --manifest-path "$manifest" -p "$pkg" --features cuda --release --message-format=json \
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
for exe in $(build test slowfast-cuda test --no-run); do
  name="$(basename "$exe")"
  cp "$exe" "$bin/slowfast_cuda-${name%-*}"
done
for exe in $(build test slowfast-engine test --no-run --test gpu_model --test gpu_serve --test gpu_speculative); do
  name="$(basename "$exe")"
  cp "$exe" "$bin/slowfast_engine-${name%-*}"
done
for exe in $(build bin slowfast-cuda build --example cuda_bench); do
  cp "$exe" "$bin/cuda_bench"
done
for exe in $(build bin slowfast build --bin slowfast); do
  cp "$exe" "$bin/slowfast"
done
# Debug line tables off: the carried folder must stay small (64 MiB with the tree).
for f in "$bin"/slowfast_cuda-* "$bin"/slowfast_engine-* "$bin"/cuda_bench "$bin"/slowfast; do
  strip --strip-debug "$f" 2>/dev/null || true
done
# The run tool sends the session's checkout: carry fixtures and the reference script too.
mkdir -p "$bin/fixtures"
cp -r tests/fixtures/hf tests/fixtures/gguf "$bin/fixtures/"
cp bench/torch_reference.py bench/serve_load.py bench/metrics_peak.py bench/prefix_cache.py bench/serve_metrics.py scripts/gpu_run.sh scripts/gpu_spec.sh scripts/serve_url.sh "$bin/"
# gpu_spec.sh's prompts (Emma, from scripts/get_texts.sh) and the default model's checksum
mkdir -p "$bin/texts"
if [ -f data/texts/austen_emma.txt ]; then cp data/texts/austen_emma.txt "$bin/texts/"; fi
M="${SLOWFAST_HOME:-$HOME/.cache/slowfast}/models/gemma-3-270m-q4_k_m.gguf"
if [ -f "$M" ]; then sha256sum "$M" | cut -c1-64 > "$bin/model.sha256"; fi
ls -la "$bin" >&2
du -sh "$bin" >&2

cat <<'CMD'
# run tool, carry [".bin"], timeout_s 600 (phases: tests kbench bench torch gen sfi sfi-ab binab ...; env CTX, N, BATCH):
bash .bin/gpu_run.sh tests bench torch
# speculative decoding (issue 20): bash .bin/gpu_spec.sh tests accept bench (the default model's
# parts carried first: scripts/gpu_default_model.sh stage)
CMD
