#!/usr/bin/env bash
# The default model (Gemma 3 270M Q4_K_M, 253 MB) on the GPU machine, which has no network and
# receives at most 64 MiB per call: the GGUF travels in parts, one per call, each copied to
# /tmp/carry there (carried paths do not outlive their call; /tmp does while the machine stays
# warm, 30 s after a call), then joined and checked against its sha256.
#
#   scripts/gpu_default_model.sh stage   # here: .gpu/ (CLI built with --features cuda, the text,
#                                        # the checksum, this script) and .m1/ ... .m8/ (the parts);
#                                        # prints the run-tool calls to make, back to back
#   bash .gpu/gpu_default_model.sh run   # there, after the parts arrived: greedy tokens on the
#                                        # GPU and the CPU, eval nll and passkey with --device cuda,
#                                        # SFI at --sfi-async-lag 0 and 4 on prose and code
#   bash .gpu/gpu_default_model.sh run fp8   # there: fp8 KV against bf16 KV (greedy, nll, passkey)
#   bash .gpu/gpu_default_model.sh run tasks # there: eval agree and ruler with --device cuda
#   bash .gpu/gpu_default_model.sh run policies # there: snapkv, pyramidkv and quest with --device cuda
#   bash .gpu/gpu_default_model.sh run cand  # there: SFI's cheaper slow step (nll, passkey, ruler)
#   bash .gpu/gpu_default_model.sh run compare  # there, from the repository root, after SmolLM2's
#                                        # parts (.m9 ... .m11) too: the rest of issue 21's policy
#                                        # comparison (scripts/compare_policies.py), GPU policies
#                                        # on the GPU, the others on the CPU cores beside it;
#                                        # detached, so a later call with the same arguments waits
#                                        # for it again; the JSON and logs come back
#                                        # in $OUT/compare.tgz
set -uo pipefail
START="$PWD"  # `run compare` reads the repository there
cd "$(dirname "$0")/.."
case "${1:-}" in
  stage)
    set -e
    M="${SLOWFAST_HOME:-$HOME/.cache/slowfast}/models/gemma-3-270m-q4_k_m.gguf"
    [ -f "$M" ] || { echo "no $M: run \`slowfast fetch\` first" >&2; exit 2; }
    [ -f data/texts/austen_prideprejudice.txt ] || scripts/get_texts.sh
    [ -f data/texts/rust_serde_json.txt ] || scripts/get_code_text.sh
    cargo build --release -p slowfast --features cuda
    S="${SLOWFAST_HOME:-$HOME/.cache/slowfast}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    for d in .gpu .m1 .m2 .m3 .m4 .m5 .m6 .m7 .m8 .m9 .m10 .m11; do
      grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
    done
    rm -rf .gpu .m1 .m2 .m3 .m4 .m5 .m6 .m7 .m8 .m9 .m10 .m11 && mkdir -p .gpu
    cp target/release/slowfast .gpu/ && strip --strip-debug .gpu/slowfast
    cp data/texts/austen_prideprejudice.txt data/texts/rust_serde_json.txt scripts/gpu_default_model.sh .gpu/
    sha256sum "$M" | cut -c1-64 > .gpu/model.sha256
    # parts of 34 MB: with the repository's tree (27 MB in December 2026) under a call's 64 MiB
    split -b 34000000 -d -a 1 "$M" /tmp/slowfast-part.
    for i in 0 1 2 3 4 5 6 7; do mkdir -p ".m$((i + 1))" && mv "/tmp/slowfast-part.$i" ".m$((i + 1))/p"; done
    if [ -f "$S" ]; then  # SmolLM2 for `run compare`, in three parts (.m9 ... .m11)
      sha256sum "$S" | cut -c1-64 > .gpu/smollm2.sha256
      split -b 33000000 -d -a 1 "$S" /tmp/slowfast-part.
      for i in 0 1 2; do mkdir -p ".m$((i + 9))" && mv "/tmp/slowfast-part.$i" ".m$((i + 9))/p"; done
    fi
    cat <<'CALLS'
# run tool, one call after the other (each within 30 s of the last):
#   carry [".gpu"]: mkdir -p /tmp/carry && cp -r .gpu /tmp/carry/
#   carry [".m1"]:  cp .m1/p /tmp/carry/m1        (and so on for .m2 ... .m8, and .m9 ... .m11
#                                                  for `run compare`)
#   then:           bash /tmp/carry/.gpu/gpu_default_model.sh run
CALLS
    ;;
  run)
    [ "${2:-}" != compare ] || [ -f "$START/scripts/compare_policies.py" ] || { echo "run compare: start it in the repository root" >&2; exit 2; }
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export SLOWFAST_HOME=/tmp/slowfast-home
    OUT="${OUT:-/tmp/out}"
    mkdir -p "$OUT"
    C=/tmp/carry
    M=/tmp/gemma-3-270m-q4_k_m.gguf
    # join FILE SHA256FILE PART...: the parts joined into FILE and checked, once. A later call
    # must not rewrite the file under running processes, which map it (a truncated mapping
    # kills them with SIGBUS), so a file that checks out stays and a new one replaces it by rename.
    join() {
      local f=$1 sum=$2; shift 2
      echo "$(cat "$sum")  $f" | sha256sum -c --quiet - 2> /dev/null && return 0
      cat "$@" > "$f.part" && mv "$f.part" "$f"
      echo "$(cat "$sum")  $f" | sha256sum -c - || exit 3
    }
    join $M $C/.gpu/model.sha256 $C/m1 $C/m2 $C/m3 $C/m4 $C/m5 $C/m6 $C/m7 $C/m8
    B=$C/.gpu/slowfast
    T=$C/.gpu/austen_prideprejudice.txt
    P="It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a"
    if [ "${2:-}" = compare ]; then
      S=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
      join $S $C/.gpu/smollm2.sha256 $C/m9 $C/m10 $C/m11
      W=/tmp/compare
      mkdir -p $W
      if ! pgrep -f "$START/scripts/compare_policies.py run" > /dev/null; then
        # started once, in its own session, so that it outlives this call; later calls wait
        setsid nohup python3 "$START/scripts/compare_policies.py" run --done "$START/docs/results/compare" --out $W \
          --bin $B --model gemma3-270m=$M smollm2-135m=$S \
          --texts prose=$T code=$C/.gpu/rust_serde_json.txt \
          --cuda-policies full,sfi,streaming,snapkv,pyramidkv,quest,h2o --only "${ONLY:-.}" \
          --workers "${CPU_WORKERS:-14}" --gpu-workers "${GPU_WORKERS:-2}" > $W/nohup.log 2>&1 < /dev/null &
        sleep 2
      fi
      for _ in $(seq "${WAIT_S:-560}"); do
        pgrep -f "$START/scripts/compare_policies.py run" > /dev/null || break
        sleep 1
      done
      # one file back: the run tool returns only a few files a call
      tar czf "$OUT/compare.tgz" -C $W --exclude nohup.log . 2>/dev/null
      tail -n 4 $W/runner.log; ls $W/*.json 2>/dev/null | wc -l
      grep -h "^error" $W/logs/*.err 2>/dev/null | head
      exit 0
    fi
    if [ "${2:-}" = tasks ]; then
      # eval's other tasks on the GPU (issue 23, item 5): agree and ruler at 8K, full, sfi and
      # streaming at a 20 % budget, for the side-by-side table with the CPU's
      $B eval --device cuda -m $M --task agree -i $T --context 8192 --eval-tokens 128 \
        --policies full,sfi,streaming --kv-budget 0.2 --json "$OUT/agree-cuda.json" > "$OUT/agree-cuda.md" 2> "$OUT/agree-cuda.err"
      $B eval --device cuda -m $M --task ruler -i $T --context 8192 --ruler-samples 4 --seed 1 \
        --policies full,sfi,streaming --kv-budget 0.2 --json "$OUT/ruler-cuda.json" > "$OUT/ruler-cuda.md" 2> "$OUT/ruler-cuda.err"
      cat "$OUT/agree-cuda.md" "$OUT/ruler-cuda.md"
      tail -n 3 "$OUT"/*.err
      exit 0
    fi
    if [ "${2:-}" = policies ]; then
      # The GPU's SnapKV, PyramidKV, Quest and H2O (issue 23) against the CPU's numbers in docs/results.md
      # ("Every policy at 8K"): nll on prose and code, passkey as the CPU's table ran it
      for t in $T $C/.gpu/rust_serde_json.txt; do
        n=$(basename $t .txt)
        $B eval --device cuda -m $M --task nll -i $t --context 8192 --policies "${NLL_POLS:-full,snapkv,pyramidkv,quest,h2o,sfi,streaming}" \
          --kv-budget 0.2 --json "$OUT/nll-$n-snap.json" > "$OUT/nll-$n-snap.md" 2> "$OUT/nll-$n-snap.err"
      done
      $B eval --device cuda -m $M --task passkey -i $T --context 8192 --passkey-trials 3 --passkey-depths 0.1,0.5,0.9 \
        --seed 1 --policies "${PK_POLS:-full,snapkv,pyramidkv,quest,h2o}" --kv-budget 0.2 --json "$OUT/pk-snap.json" > "$OUT/pk-snap.md" 2> "$OUT/pk-snap.err"
      cat "$OUT"/nll-*-snap.md "$OUT/pk-snap.md"
      tail -n 3 "$OUT"/*.err
      exit 0
    fi
    if [ "${2:-}" = cand ]; then
      # SFI's cheaper slow step on the GPU (issue 27) against the CPU's numbers in docs/results.md
      # ("A cheaper slow step"): nll on prose and code at 8K and 20 %, dense slow steps
      # (--sfi-candidates 0), sfi-c2p6 (--sfi-candidates 2, a slow step every 6) and the cheap
      # slow step on the trigger's schedule (--sfi-candidates 2, the default), then passkey and
      # RULER with sfi-c2p6
      NEW="--sfi-candidates 2 --sfi-trigger periodic --sfi-refresh-interval 6"
      for t in $T $C/.gpu/rust_serde_json.txt; do
        n=$(basename $t .txt)
        $B eval --device cuda -m $M --task nll -i $t --context 8192 --policies full,sfi --kv-budget 0.2 --sfi-candidates 0 \
          --json "$OUT/nll-$n-sfi.json" > "$OUT/nll-$n-sfi.md" 2> "$OUT/nll-$n-sfi.err"
        $B eval --device cuda -m $M --task nll -i $t --context 8192 --policies sfi --kv-budget 0.2 $NEW \
          --json "$OUT/nll-$n-c2p6.json" > "$OUT/nll-$n-c2p6.md" 2> "$OUT/nll-$n-c2p6.err"
        $B eval --device cuda -m $M --task nll -i $t --context 8192 --policies sfi --kv-budget 0.2 --sfi-candidates 2 \
          --json "$OUT/nll-$n-c2.json" > "$OUT/nll-$n-c2.md" 2> "$OUT/nll-$n-c2.err"
      done
      $B eval --device cuda -m $M --task passkey -i $T --context 8192 --passkey-trials 10 --seed 1 \
        --policies sfi --kv-budget 0.2 $NEW --json "$OUT/pk-c2p6.json" > "$OUT/pk-c2p6.md" 2> "$OUT/pk-c2p6.err"
      $B eval --device cuda -m $M --task ruler -i $T --context 8192 --ruler-samples 4 --seed 1 \
        --policies sfi --kv-budget 0.2 $NEW --json "$OUT/ruler-c2p6.json" > "$OUT/ruler-c2p6.md" 2> "$OUT/ruler-c2p6.err"
      cat "$OUT"/nll-*-sfi.md "$OUT"/nll-*-c2p6.md "$OUT"/nll-*-c2.md "$OUT/pk-c2p6.md" "$OUT/ruler-c2p6.md"
      tail -n 3 "$OUT"/*.err
      exit 0
    fi
    if [ "${2:-}" = fp8 ]; then
      # fp8 KV (issue 22) against bf16 KV on the GPU: greedy tokens, eval nll on prose and
      # code (full, sfi, streaming at a 20 % budget) and passkey, at 8K
      {
        for kv in f16 fp8; do
          echo "== cuda --kv-dtype $kv"; $B generate --device cuda -m $M -p "$P" -n 32 --temperature 0 --ignore-eos --kv-dtype $kv
        done
      } > "$OUT/greedy-fp8.log" 2>&1
      for kv in f16 fp8; do
        for t in $T $C/.gpu/rust_serde_json.txt; do
          n=$(basename $t .txt)
          $B eval --device cuda -m $M --task nll -i $t --context 8192 --policies full,sfi,streaming --kv-budget 0.2 \
            --kv-dtype $kv --json "$OUT/nll-$n-$kv.json" > "$OUT/nll-$n-$kv.md" 2> "$OUT/nll-$n-$kv.err"
        done
        $B eval --device cuda -m $M --task passkey -i $T --context 8192 --passkey-trials 10 --seed 1 \
          --policies full,sfi --kv-budget 0.2 --kv-dtype $kv --json "$OUT/pk-$kv.json" > "$OUT/pk-$kv.md" 2> "$OUT/pk-$kv.err"
      done
      cat "$OUT/greedy-fp8.log" "$OUT"/nll-*-f16.md "$OUT"/nll-*-fp8.md "$OUT"/pk-f16.md "$OUT"/pk-fp8.md
      tail -n 3 "$OUT"/*.err
      exit 0
    fi
    {
      echo "== cuda"; $B generate --device cuda -m $M -p "$P" -n 32 --temperature 0 --ignore-eos
      echo; echo "== cpu f32 KV"; $B generate --device cpu -m $M -p "$P" -n 32 --temperature 0 --ignore-eos --kv-dtype f32
    } > "$OUT/greedy.log" 2>&1
    $B eval --device cuda -m $M --task nll -i $T --context 8192 --policies full,sfi,streaming --kv-budget 0.2 \
      --json "$OUT/nll-cuda.json" > "$OUT/nll-cuda.md" 2> "$OUT/nll-cuda.err"
    $B eval --device cuda -m $M --task passkey -i $T --context 8192 --passkey-trials 10 --seed 1 \
      --policies full,sfi,streaming --kv-budget 0.2 --json "$OUT/pk-cuda.json" > "$OUT/pk-cuda.md" 2> "$OUT/pk-cuda.err"
    # SFI's refresh in order (lag 0, the default) against the asynchronous refresh (lag 4), on
    # the prose above and on source code (scripts/get_code_text.sh), at 8K and a 20 % budget
    for lag in 0 4; do
      for t in $T $C/.gpu/rust_serde_json.txt; do
        n=$(basename $t .txt)
        $B eval --device cuda -m $M --task nll -i $t --context 8192 --policies full,sfi --kv-budget 0.2 \
          --sfi-async-lag $lag --json "$OUT/nll-$n-lag$lag.json" > "$OUT/nll-$n-lag$lag.md" 2> "$OUT/nll-$n-lag$lag.err"
      done
      $B eval --device cuda -m $M --task passkey -i $T --context 8192 --passkey-trials 10 --seed 1 \
        --policies sfi --kv-budget 0.2 --sfi-async-lag $lag --json "$OUT/pk-lag$lag.json" > "$OUT/pk-lag$lag.md" 2> "$OUT/pk-lag$lag.err"
    done
    cat "$OUT/greedy.log" "$OUT/nll-cuda.md" "$OUT/pk-cuda.md" "$OUT"/nll-*-lag*.md "$OUT"/pk-lag*.md
    ;;
  *)
    echo "usage: scripts/gpu_default_model.sh stage | run" >&2
    exit 2
    ;;
esac
