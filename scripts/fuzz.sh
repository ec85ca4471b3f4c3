#!/usr/bin/env bash
# Coverage-guided fuzzing of slowfast's parsers with cargo-fuzz (libFuzzer). See docs/fuzzing.md.
#
#   scripts/fuzz.sh --ci                 build, ~30 s per target, replay fuzz/regressions/
#   scripts/fuzz.sh --long SECONDS [T..] campaign: SECONDS per target (T=SECONDS: that target's)
#   scripts/fuzz.sh --runs N [T..]       campaign: N executions per target
#   scripts/fuzz.sh --build              build the targets and seed the corpora only
#   --fork N (with --long)               N libFuzzer worker processes per target (-fork=N)
#
# Environment: FUZZ_CI_SECONDS (default 30), SLOWFAST_FUZZ_MODEL (default model path),
# FUZZ_RSS_MB (2048), FUZZ_TIMEOUT (10), FUZZ_WORK (where corpus/ artifacts/ logs/ go; fuzz/),
# FUZZ_BIN (prebuilt target binaries: no toolchain needed, nothing built),
# FUZZ_SANITIZER (address; `none` builds without ASan, for faster campaigns).
set -euo pipefail

ALL_TARGETS=(gguf safetensors hf_config tokenizer chat_template http_body cli_parsers)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FUZZ="$ROOT/fuzz"
# corpus/, artifacts/ and logs/ go here (FUZZ_WORK overrides, e.g. for two runs at once)
WORK="${FUZZ_WORK:-$FUZZ}"
CI_SECONDS="${FUZZ_CI_SECONDS:-30}"
RSS_MB="${FUZZ_RSS_MB:-2048}"
TIMEOUT="${FUZZ_TIMEOUT:-10}"
MODEL="${SLOWFAST_FUZZ_MODEL:-$HOME/.cache/slowfast/models/gemma-3-270m-q4_k_m.gguf}"

usage() {
    sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    echo "targets: ${ALL_TARGETS[*]}"
}
die() { echo "fuzz.sh: $*" >&2; exit 2; }

MODE="" ; AMOUNT="" ; FORK=0
TARGETS=()
declare -A SECS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --ci) MODE=ci ;;
        --build) MODE=build ;;
        --long|--runs)
            MODE="${1#--}"
            [[ $# -ge 2 && "$2" =~ ^[0-9]+$ && "$2" -gt 0 ]] || die "$1 needs a positive integer"
            AMOUNT="$2"; shift ;;
        --fork)
            [[ $# -ge 2 && "$2" =~ ^[0-9]+$ && "$2" -gt 0 ]] || die "--fork needs a positive integer"
            FORK="$2"; shift ;;
        -*) die "unknown option $1 (see --help)" ;;
        *)
            t="${1%%=*}"
            [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || die "unknown target \`$t\` (targets: ${ALL_TARGETS[*]})"
            if [[ "$1" == *=* ]]; then
                [[ "${1#*=}" =~ ^[0-9]+$ && "${1#*=}" -gt 0 ]] || die "$1: seconds must be a positive integer"
                SECS[$t]="${1#*=}"
            fi
            TARGETS+=("$t") ;;
    esac
    shift
done
[[ -n "$MODE" ]] || { usage >&2; die "give --ci, --long SECONDS, --runs N or --build"; }
[[ ${#TARGETS[@]} -gt 0 ]] || TARGETS=("${ALL_TARGETS[@]}")
[[ "$FORK" -eq 0 || "$MODE" == long ]] || die "--fork goes with --long (libFuzzer's fork mode runs for a time, not a count)"
command -v python3 >/dev/null || die "python3 is needed to prepare the seed corpora"

# -- build (once, all targets), unless FUZZ_BIN names prebuilt ones ---------------------------
T0=$(date +%s)
SANITIZER="${FUZZ_SANITIZER:-address}"
if [[ -n "${FUZZ_BIN:-}" ]]; then
    BIN="$(cd "$FUZZ_BIN" && pwd)" || die "FUZZ_BIN=$FUZZ_BIN is not a folder"
    for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || die "no fuzz binary $BIN/$t"; done
else
    rustup toolchain list 2>/dev/null | grep -q '^nightly' \
        || die "cargo-fuzz needs a nightly toolchain: rustup toolchain install nightly"
    if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
        echo "== installing cargo-fuzz"
        cargo +nightly install cargo-fuzz --locked || cargo install cargo-fuzz --locked \
            || die "could not install cargo-fuzz"
    fi
    echo "== building fuzz targets (cargo +nightly fuzz build -s $SANITIZER)"
    tdir=()
    [[ "$SANITIZER" == address ]] || tdir=(--target-dir "$FUZZ/target-$SANITIZER")
    (cd "$FUZZ" && cargo +nightly fuzz build -s "$SANITIZER" "${tdir[@]}") || die "build failed"
    TRIPLE="$(rustc +nightly -vV | sed -n 's/^host: //p')"
    if [[ "$SANITIZER" == address ]]; then BIN="$FUZZ/target/$TRIPLE/release"
    else BIN="$FUZZ/target-$SANITIZER/$TRIPLE/release"; fi
    echo "   built in $(( $(date +%s) - T0 )) s"
fi

# -- corpora: committed seeds + fixtures + the default model's header -----------------------
mkdir -p "$WORK/corpus" "$WORK/artifacts" "$WORK/logs"
python3 "$FUZZ/make_seeds.py" "$ROOT" "$WORK/corpus" "$MODEL"
for t in "${ALL_TARGETS[@]}"; do mkdir -p "$WORK/corpus/$t" "$WORK/artifacts/$t"; done
[[ -f "$MODEL" ]] || echo "   (no default model at $MODEL: SentencePiece targets use the llama-tiny fixture)"

dict_of() {
    case "$1" in
        gguf) echo "$FUZZ/dicts/gguf.dict" ;;
        safetensors|hf_config|http_body) echo "$FUZZ/dicts/json.dict" ;;
        chat_template) echo "$FUZZ/dicts/template.dict" ;;
        cli_parsers) echo "$FUZZ/dicts/cli.dict" ;;
        *) echo "" ;;
    esac
}
max_len_of() {
    case "$1" in
        gguf) echo 131072 ;;
        hf_config|safetensors) echo 65536 ;;
        *) echo 8192 ;;
    esac
}

# Run one target; $2 is the libFuzzer budget flag. Writes logs/<t>.log and prints a summary.
fuzz_one() {
    local t="$1" budget="$2" d flags log rc
    d="$(dict_of "$t")"
    log="$WORK/logs/$t.log"
    flags=(-timeout="$TIMEOUT" -rss_limit_mb="$RSS_MB" -malloc_limit_mb="$RSS_MB"
           -max_len="$(max_len_of "$t")" -print_final_stats=1
           -artifact_prefix="$WORK/artifacts/$t/" "$budget")
    [[ -n "$d" ]] && flags+=(-dict="$d")
    # fork mode: FORK worker processes share the corpus; the parent prints the running totals
    [[ "$FORK" -gt 0 ]] && flags+=(-fork="$FORK")
    local s0; s0=$(date +%s)
    set +e
    "$BIN/$t" "${flags[@]}" "$WORK/corpus/$t" >"$log" 2>&1
    rc=$?
    set -e
    local secs=$(( $(date +%s) - s0 ))
    local execs cov ft corp crashes
    if [[ "$FORK" -gt 0 ]]; then  # the parent's last "#N: cov: .. ft: .." line: N executions
        execs=$(sed -n 's/^#\([0-9][0-9]*\): cov:.*/\1/p' "$log" | tail -1)
    else
        execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    fi
    cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
    ft=$(grep -oE 'ft: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
    corp=$(find "$WORK/corpus/$t" -type f | wc -l)
    crashes=$(find "$WORK/artifacts/$t" -type f \( -name 'crash-*' -o -name 'timeout-*' \
        -o -name 'oom-*' -o -name 'leak-*' -o -name 'slow-unit-*' \) | wc -l)
    printf '%-14s execs=%-10s time=%-5ss corpus=%-6s cov=%-6s ft=%-6s crashes=%s rc=%s%s\n' \
        "$t" "${execs:-?}" "$secs" "$corp" "${cov:-?}" "${ft:-?}" "$crashes" "$rc" \
        "$([[ "$FORK" -gt 0 ]] && echo " fork=$FORK")"
    if [[ $rc -ne 0 ]]; then
        echo "   !! $t failed (rc=$rc); see $log and $WORK/artifacts/$t/" >&2
        grep -E '^(==[0-9]+==ERROR|thread .* panicked|SUMMARY)' "$log" | head -5 >&2 || true
        return 1
    fi
}

# Replay every committed regression input once (libFuzzer runs file arguments and exits).
replay() {
    local t="$1" dir="$FUZZ/regressions/$1"
    [[ -d "$dir" ]] || return 0
    local files=("$dir"/*)
    [[ -e "${files[0]}" ]] || return 0
    if ! "$BIN/$t" -timeout="$TIMEOUT" -rss_limit_mb="$RSS_MB" -malloc_limit_mb="$RSS_MB" \
        "${files[@]}" >"$WORK/logs/$t.replay.log" 2>&1; then
        echo "   !! $t: a regression input fails again; see $WORK/logs/$t.replay.log" >&2
        return 1
    fi
    echo "   $t: replayed ${#files[@]} regression input(s)"
}

FAILED=()
case "$MODE" in
    build) exit 0 ;;
    ci)
        echo "== CI: ${CI_SECONDS} s per target, then regression replay"
        for t in "${TARGETS[@]}"; do
            fuzz_one "$t" -max_total_time="$CI_SECONDS" || FAILED+=("$t")
            replay "$t" || FAILED+=("$t(regression)")
        done ;;
    long)
        echo "== campaign: $AMOUNT s per target"
        for t in "${TARGETS[@]}"; do
            fuzz_one "$t" -max_total_time="${SECS[$t]:-$AMOUNT}" || FAILED+=("$t")
        done ;;
    runs)
        echo "== campaign: $AMOUNT executions per target"
        for t in "${TARGETS[@]}"; do fuzz_one "$t" -runs="$AMOUNT" || FAILED+=("$t"); done ;;
esac
echo "== total wall time $(( $(date +%s) - T0 )) s"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "fuzz.sh: FAILED: ${FAILED[*]}" >&2
    exit 1
fi
echo "fuzz.sh: no crashes"
