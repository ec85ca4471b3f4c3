#!/usr/bin/env bash
# Runs on the GPU machine (copied to .bin/ by scripts/gpu_test.sh): the GPU tests, the
# `slowfast bench --device cuda` sweep and the PyTorch reference, logs under $OUT.
#   bash .bin/gpu_run.sh [tests] [bench] [torch] [sfi] ...   (default: tests bench torch)
#   (phase `faults` runs tests/serve/fault_storm.py from the checkout against `serve --device cuda`)
set -uo pipefail
# serve_url: wait for a server's "listening on" line (beside this script, as in .bin/)
. "$(dirname "$0")/serve_url.sh"
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export SLOWFAST_REQUIRE_GPU=1 SLOWFAST_REQUIRE_NVRTC=1 PYTHONUNBUFFERED=1
export SLOWFAST_FIXTURES="$PWD/.bin/fixtures" SLOWFAST_HOME="${SLOWFAST_HOME:-/tmp/slowfast-home}"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
phases="${*:-tests bench torch}"
CTX="${CTX:-8k,16k,32k,64k,128k}"
N="${N:-64}"
# SFI's memory budget a head and its slow-step interval (the paper's sweep setting)
SFI_OPTS="--kv-budget ${BUDGET:-2048} --sfi-refresh-interval ${RI:-32} ${SFI_EXTRA:-}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv > "$OUT/nvidia-smi.txt" 2>&1
rc=0
for p in $phases; do
  case "$p" in
    tests)
      # TESTS: the test binaries to run (default: all of them)
      for t in ${TESTS:-.bin/slowfast_cuda-* .bin/slowfast_engine-*}; do
        echo "== $t" | tee -a "$OUT/tests.log"
        $t --test-threads=1 --nocapture 2>&1 | tee -a "$OUT/tests.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      done
      echo "tests rc=$rc" | tee -a "$OUT/tests.log" ;;
    kbench)
      .bin/cuda_bench quick 2>&1 | tee "$OUT/kernel-bench.log" ;;
    pbench)
      # the head-dim-128 prefill attention kernels side by side at 8K and 32K (cuda_bench prefill)
      .bin/cuda_bench prefill 2>&1 | tee "$OUT/prefill-bench.log" ;;
    dbench)
      # flash-decoding alone (cuda_bench decode): batch 1 at 8K / 32K / 128K and 33 keys past
      # each, batch 8 at 8K / 32K
      .bin/cuda_bench decode 2>&1 | tee -a "$OUT/decode-bench.log" ;;
    gemvb)
      # 3-8 rows through each decode projection: cuBLAS against the tensor-core GEMV
      .bin/cuda_bench gemvb 2>&1 | tee "$OUT/gemvb-bench.log" ;;
    gemv)
      # the 1-row GEMV kernels against the pure read rate, shape by shape, and as a 36-layer chain
      .bin/cuda_bench gemv 2>&1 | tee "$OUT/gemv-bench.log" ;;
    ncu-attn)
      # one batch-1 32K flash-decoding launch under ncu's full section set (occupancy, stalls)
      /usr/local/cuda/bin/ncu --set full -k regex:attn_decode_d128 --launch-skip 3 --launch-count 1 \
        .bin/cuda_bench profile > "$OUT/ncu-attn.txt" 2>&1
      grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Stall|Warp Cycles|Registers|Theoretical Occupancy|Block Limit|L2 Hit|Eligible|Issued Warp" "$OUT/ncu-attn.txt" | head -60 ;;
    ncu-gemv)
      # the 6-row tensor-core GEMV beside the 1-row fused GEMV (o, gate|up, down; cuda_bench
      # profile-gemv) under ncu's full section set: DRAM rate, stalls, occupancy, sectors a request
      /usr/local/cuda/bin/ncu --set full -k regex:gemv --launch-count 12 \
        .bin/cuda_bench profile-gemv > "$OUT/ncu-gemv.txt" 2>&1
      grep -E "^  [a-z_0-9]+\(|gemv_|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|L2 Hit|Issued Warp|Warp Cycles Per Issued|Eligible|Active Warps|Waves Per SM|Grid Size|Dynamic Shared|Static Shared" "$OUT/ncu-gemv.txt" | head -300 ;;
    trace)
      # where a graph-replayed step's time goes, PDL overlaps in place (src/trace.rs): for each
      # TR_BATCH (default "1 6"), `slowfast bench` at CTX_TR (8k) over TR_POL (streaming,sfi)
      # with SLOWFAST_TRACE; the summaries are in trace-b<batch><TR_TAG>.log, the records in
      # traces<TR_TAG>.tgz
      tag="${TR_TAG:-}"
      for b in ${TR_BATCH:-1 6}; do
        SLOWFAST_TRACE=/tmp/trace$tag .bin/slowfast bench --device cuda --model random:qwen3-4b \
          --contexts "${CTX_TR:-8k}" --batch "$b" --policies "${TR_POL:-streaming,sfi}" \
          --new-tokens 32 $SFI_OPTS > "$OUT/trace-b$b$tag.log" 2>&1 || rc=1
        grep -A30 "^trace " "$OUT/trace-b$b$tag.log"
      done
      tar czf "$OUT/traces$tag.tgz" -C /tmp "trace$tag" ;;
    prof)
      # per-kernel times and DRAM bytes of a decode at CTX_PROF, batch PROF_BATCH (default 1)
      # under ncu (the machine has no nsys): kernels one at a time (no PDL overlap), warm caches,
      # free clocks; PROF_ARGS: more bench flags (e.g. --policies streaming), PROF_TAG: a name
      # for the output files; PROF_GRAPH=graph profiles each replayed CUDA graph as one unit (its
      # kernels overlapping as in the step) instead of node by node. Summed by kernel name at
      # the end (by graph with PROF_GRAPH=graph; not yet tried: ncu may need PROF_K=".*" there).
      tag="${PROF_TAG:-prof}"
      /usr/local/cuda/bin/ncu --graph-profiling "${PROF_GRAPH:-node}" --cache-control none --clock-control none \
        -k regex:"${PROF_K:-gemv|attn_decode|qkv_post|argmax|rmsnorm|embed|advance}" \
        --launch-skip "${PROF_SKIP:-1500}" --launch-count "${PROF_N:-300}" \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active \
        --csv .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX_PROF:-32k}" \
        --batch "${PROF_BATCH:-1}" --new-tokens 32 ${PROF_ARGS:-} > "$OUT/$tag-ncu.csv" 2> "$OUT/$tag-run.log"
      tail -3 "$OUT/$tag-run.log"
      python3 - "$OUT/$tag-ncu.csv" <<'PY' | tee "$OUT/$tag-summary.txt"
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; ki = head.index("Kernel Name"); mi = head.index("Metric Name")
vi = head.index("Metric Value"); ui = head.index("Metric Unit")
tot = collections.defaultdict(float); byt = collections.defaultdict(float); cnt = collections.Counter()
for r in rows[1:]:
    try: v = float(r[vi].replace(",", ""))
    except ValueError: continue
    name = r[ki].split("(")[0][:70]
    if r[mi] == "gpu__time_duration.sum":
        v *= {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[r[ui]]
        tot[name] += v; cnt[name] += 1
    elif r[mi] == "dram__bytes_read.sum":
        v *= {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(r[ui], 1)
        byt[name] += v
all_us = sum(tot.values())
for n, us in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{us:10.1f} us {100*us/all_us:6.2f} % {cnt[n]:5d} x {us/cnt[n]:8.2f} us  {byt[n]/us/1e3 if us else 0:7.0f} GB/s  {n}")
print(f"{all_us:10.1f} us total over {sum(cnt.values())} kernels")
PY
      ;;
    prof-prefill)
      # per-kernel times of a CTX_PROF (default 32k) prefill under ncu, kernels one at a time:
      # where the time outside attention and the GEMMs goes. Summed by kernel name at the end.
      /usr/local/cuda/bin/ncu --cache-control none --clock-control none \
        --launch-count "${PROF_N:-2400}" --metrics gpu__time_duration.sum --csv \
        .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX_PROF:-32k}" \
        --batch 1 --new-tokens 2 > "$OUT/prefill-ncu.csv" 2> "$OUT/prefill-run.log"
      python3 - "$OUT/prefill-ncu.csv" <<'PY' | tee "$OUT/prefill-ncu-summary.txt"
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; ki = head.index("Kernel Name"); vi = head.index("Metric Value"); ui = head.index("Metric Unit")
tot = collections.defaultdict(float); cnt = collections.Counter()
for r in rows[1:]:
    try: v = float(r[vi].replace(",", ""))
    except ValueError: continue
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
             "second": 1e6, "s": 1e6}[r[ui]]
    name = r[ki].split("(")[0][:60]; tot[name] += v * scale; cnt[name] += 1
all_us = sum(tot.values())
for n, us in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{us/1e3:10.2f} ms {100*us/all_us:6.2f} % {cnt[n]:6d} x  {n}")
print(f"{all_us/1e3:10.2f} ms total over {sum(cnt.values())} kernels")
PY
      ;;
    bench)
      .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "$CTX" --batch 1 \
        --new-tokens "$N" --json "$OUT/bench-b1.json" 2>&1 | tee "$OUT/bench.log"
      .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX_B:-8k,32k}" \
        --batch "${BATCH:-8}" --new-tokens "$N" --json "$OUT/bench-b8.json" 2>&1 | tee -a "$OUT/bench.log" ;;
    ab)
      # A/B of the fused decode step (ops/fused.rs) at batch 1: plain kernels, fused
      # without PDL, fused with PDL (the default), at CTX_AB; AB_CFGS: other VAR=value settings.
      for cfg in ${AB_CFGS:-SLOWFAST_DECODE_FUSED=0 SLOWFAST_PDL=0 SLOWFAST_PDL=1}; do
        echo "== $cfg" | tee -a "$OUT/ab.log"
        env "$cfg" .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX_AB:-8k,128k}" \
          --batch 1 --new-tokens "$N" 2>&1 | tee -a "$OUT/ab.log"
      done ;;
    bench4)
      .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX_4:-128k}" \
        --batch 4 --new-tokens "$N" --json "$OUT/bench-b4.json" 2>&1 | tee -a "$OUT/bench.log" ;;
    sfi)
      # SFI on the GPU (issue 6): full, sfi, streaming side by side at batch 1 and at the
      # largest batch that fits at 128K (SB, default 6), budget 2048 tokens a head, a slow
      # step every 32 steps per sequence (the paper's sweep setting).
      SFI_ARGS="--policies full,sfi,streaming $SFI_OPTS"
      .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "$CTX" --batch 1 \
        --new-tokens "$N" $SFI_ARGS --json "$OUT/sfi-b1.json" 2>&1 | tee "$OUT/sfi.log"
      .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX_SB:-128k}" \
        --batch "${SB:-6}" --new-tokens "$N" $SFI_ARGS --json "$OUT/sfi-b${SB:-6}.json" 2>&1 | tee -a "$OUT/sfi.log" ;;
    cand)
      # SFI's cheaper slow step (issue 27): dense slow steps (--sfi-candidates 0) every 32 steps a
      # sequence against --sfi-candidates 2 (the default) on the same schedule, with a slow step every 6
      # ("sfi-c2p6") and dense slow steps every 6, batches CAND_B (1 6) at CAND_CTX
      # (32k,128k), alternated CAND_REPS (1) times; CAND_VARIANTS picks variants by name;
      # CAND_PREFILL: more flags (e.g. --real-prefill 8192 at batch 6)
      for rep in ${CAND_REPS:-1}; do
        for b in ${CAND_B:-1 6}; do
          for v in "dense32:--sfi-candidates 0 --sfi-refresh-interval 32" "cand32:--sfi-candidates 2 --sfi-refresh-interval 32" \
                   "cand6:--sfi-candidates 2 --sfi-trigger periodic --sfi-refresh-interval 6" \
                   "dense6:--sfi-candidates 0 --sfi-trigger periodic --sfi-refresh-interval 6"; do
            name="${v%%:*}"
            case " ${CAND_VARIANTS:-dense32 cand32 cand6 dense6} " in *" $name "*) ;; *) continue ;; esac
            echo "== rep $rep batch $b $name" | tee -a "$OUT/cand.log"
            .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CAND_CTX:-32k,128k}" \
              --batch "$b" --new-tokens "$N" --policies sfi --kv-budget "${BUDGET:-2048}" ${v#*:} \
              ${CAND_PREFILL:-} --json "$OUT/cand-$name-b$b-r$rep.json" 2>&1 | tee -a "$OUT/cand.log" || rc=1
          done
        done
      done ;;
    policies)
      # Every GPU policy in one run (issue 23): full, streaming, sfi, snapkv, pyramidkv, quest, h2o
      # (POLS) at batch 1 (PCTX: 8k,32k,128k) and batch PB (6) at the same contexts; budget and
      # interval as in `sfi`
      POL_ARGS="--policies ${POLS:-full,streaming,sfi,snapkv,pyramidkv,quest,h2o} $SFI_OPTS"
      .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${PCTX:-8k,32k,128k}" --batch 1 \
        --new-tokens "$N" $POL_ARGS --json "$OUT/policies-b1.json" 2>&1 | tee "$OUT/policies.log"
      .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${PCTX:-8k,32k,128k}" --batch "${PB:-6}" \
        --new-tokens "$N" $POL_ARGS --json "$OUT/policies-b${PB:-6}.json" 2>&1 | tee -a "$OUT/policies.log" ;;
    paged)
      # Paged KV (issue 22, the server's layout) against the KV allocated whole: full, sfi and
      # streaming at batch 1 (PCTX: 8k,32k,128k) and batch PB (6) at PCTX_B (32k,128k), the two
      # layouts alternated PREPS (1 2) times; budget and interval as in `sfi`
      for rep in ${PREPS:-1 2}; do
        for lay in contiguous paged; do
          flag=""; [ "$lay" = paged ] && flag="--paged-kv"
          echo "== rep $rep $lay batch 1" | tee -a "$OUT/paged.log"
          .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${PCTX:-8k,32k,128k}" --batch 1 \
            --new-tokens "$N" --policies full,sfi,streaming $SFI_OPTS $flag \
            --json "$OUT/paged-$lay-b1-r$rep.json" 2>&1 | tee -a "$OUT/paged.log"
          echo "== rep $rep $lay batch ${PB:-6}" | tee -a "$OUT/paged.log"
          .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${PCTX_B:-32k,128k}" --batch "${PB:-6}" \
            --new-tokens "$N" --policies full,sfi,streaming $SFI_OPTS $flag \
            --json "$OUT/paged-$lay-b${PB:-6}-r$rep.json" 2>&1 | tee -a "$OUT/paged.log"
        done
      done ;;
    capacity)
      # Mixed workload (issue 22): CAP_REQS (32) requests at once, prompt lengths geometric from
      # 1K to 124K (16 values, cycled), N tokens each, greedy, full KV, to `serve --device cuda
      # --max-context 131072 --kv-memory CAP_GIB GiB` (108: six 128K slots of Qwen3-4B) with
      # --max-batch 6 (what slots allocated whole held in that memory), then 32 (CAP_LIST: "6 32");
      # bench/metrics_peak.py records the peak running sequences and KV bytes. CAP_LENS: other
      # prompt lengths (chat-length: 1024,1280,...,32768 with N=512). CAP_POLICY: the server's
      # policy and flags (default full; e.g. "snapkv --kv-budget 2048", whose slots give back
      # their prompt's pages after its compaction).
      lens="${CAP_LENS:-1024,1412,1947,2686,3704,5108,7045,9716,13400,18481,25488,35152,48480,66862,92212,126976}"
      for slots in ${CAP_LIST:-6 32}; do
        log="$OUT/cap-$slots${CAP_TAG:-}.log"
        echo "== capacity: --max-batch $slots" | tee -a "$OUT/capacity.log"
        .bin/slowfast serve --device cuda --model random:qwen3-4b --max-batch "$slots" --max-context 131072 \
          --kv-memory $(( ${CAP_GIB:-108} << 30 )) --max-queue 256 --max-body-bytes 67108864 --port 0 \
          --policy ${CAP_POLICY:-full} > "$log" 2>&1 &
        spid=$!
        url="$(serve_url "$log" "$spid")"
        if [ -z "$url" ]; then tail -20 "$log" | tee -a "$OUT/capacity.log"; rc=1; continue; fi
        python3 .bin/metrics_peak.py --url "$url" --json "$OUT/cap-$slots${CAP_TAG:-}-peak.json" &
        ppid=$!
        python3 .bin/serve_load.py --url "$url" --token-ids --vocab 151936 --concurrency "${CAP_REQS:-32}" \
          --requests "${CAP_REQS:-32}" --max-tokens "$N" --prompt-lengths "$lens" --ignore-eos \
          --disconnect-fraction 0 --temperature 0 --timeout 1800 --settle-timeout 30 \
          --json "$OUT/cap-$slots${CAP_TAG:-}.json" 2>&1 | tee -a "$OUT/capacity.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        kill "$ppid"; wait "$ppid"
        nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/capacity.log"
        kill "$spid"; wait "$spid" 2>/dev/null
      done ;;
    long)
      # One sequence at LCTX (8k,128k,256k,512k; issue 22's scale with context, bf16 KV: 1M
      # needs fp8): full and sfi at batch 1, the KV before the last 8192 positions filled
      # (--real-prefill 8192); budget and interval as in `sfi`
      .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${LCTX:-8k,128k,256k,512k}" \
        --batch 1 --new-tokens "$N" --policies full,sfi $SFI_OPTS --real-prefill 8192 \
        --json "$OUT/long.json" 2>&1 | tee "$OUT/long.log" ;;
    fp8)
      # fp8 KV against bf16 KV (issue 22), both allocated whole: full, sfi and streaming at
      # batch 1 (PCTX: 8k,32k,128k) and batch PB (6) at PCTX_B (32k,128k), the two alternated
      # FREPS (1) times; budget and interval as in `sfi`
      for rep in ${FREPS:-1}; do
        for kv in f16 fp8; do
          echo "== rep $rep kv $kv batch 1" | tee -a "$OUT/fp8.log"
          .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${PCTX:-8k,32k,128k}" --batch 1 \
            --new-tokens "$N" --policies full,sfi,streaming $SFI_OPTS --kv-dtype $kv \
            --json "$OUT/fp8-$kv-b1-r$rep.json" 2>&1 | tee -a "$OUT/fp8.log"
          echo "== rep $rep kv $kv batch ${PB:-6}" | tee -a "$OUT/fp8.log"
          .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${PCTX_B:-32k,128k}" --batch "${PB:-6}" \
            --new-tokens "$N" --policies full,sfi,streaming $SFI_OPTS --kv-dtype $kv \
            --json "$OUT/fp8-$kv-b${PB:-6}-r$rep.json" 2>&1 | tee -a "$OUT/fp8.log"
        done
      done ;;
    fp8cap)
      # FB (12) sequences at 128K with fp8 KV on one H200 (issue 22's target: SFI >= 2000
      # tok/s there), the KV before the last 8192 positions filled; FPOLS (full,sfi), then
      # FCAND (unset: skipped) SFI again with --sfi-candidates FCAND (0: dense slow steps, the
      # comparison for the default 2; builds before 8c00a91 had 0 as the default), FRIDE
      # (unset: skipped) SFI again with --sfi-ride FRIDE
      .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${FCTX:-128k}" --batch "${FB:-12}" \
        --new-tokens "$N" --policies "${FPOLS:-full,sfi}" $SFI_OPTS --kv-dtype fp8 --real-prefill 8192 \
        --json "$OUT/fp8cap-b${FB:-12}.json" 2>&1 | tee "$OUT/fp8cap.log"
      if [ -n "${FRIDE:-}" ]; then
        # SFI again with --sfi-ride FRIDE (off: each sequence's slow step on its own; the
        # comparison for the default, on)
        .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${FCTX:-128k}" --batch "${FB:-12}" \
          --new-tokens "$N" --policies sfi $SFI_OPTS --sfi-ride "$FRIDE" --kv-dtype fp8 --real-prefill 8192 \
          --json "$OUT/fp8cap-b${FB:-12}-ride-$FRIDE.json" 2>&1 | tee -a "$OUT/fp8cap.log"
      fi
      if [ -n "${FCAND:-}" ]; then
        .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${FCTX:-128k}" --batch "${FB:-12}" \
          --new-tokens "$N" --policies sfi $SFI_OPTS --sfi-candidates "$FCAND" --kv-dtype fp8 --real-prefill 8192 \
          --json "$OUT/fp8cap-b${FB:-12}-cand.json" 2>&1 | tee -a "$OUT/fp8cap.log"
      fi ;;
    fp8long)
      # One sequence at FLCTX (8k,128k,256k,512k,1m) with fp8 KV: full and sfi, the KV before
      # the last 8192 positions filled (issue 22's scale with context)
      .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${FLCTX:-8k,128k,256k,512k,1m}" \
        --batch 1 --new-tokens "$N" --policies full,sfi $SFI_OPTS --kv-dtype fp8 --real-prefill 8192 \
        --json "$OUT/fp8long.json" 2>&1 | tee "$OUT/fp8long.log" ;;
    prefix)
      # GPU prefix cache (issue 22): PREQS (32) greedy requests of 16 tokens sharing a system
      # prompt cut from Emma (random:qwen3-4b's tokenizer is byte-level: 8525 tokens, the first
      # 8192 one whole prefill part), sent at once to `serve --device cuda --max-batch 32`
      # with the cache off, then on (bench/prefix_cache.py: TTFT, KV, texts identical)
      python3 .bin/prefix_cache.py --slowfast .bin/slowfast --model random:qwen3-4b \
        --system-file .bin/texts/austen_emma.txt --system-tokens 2000 --requests "${PREQS:-32}" \
        --max-batch 32 --max-context 16384 --serve-arg=--device --serve-arg=cuda \
        --json "$OUT/prefix.json" 2>&1 | tee "$OUT/prefix.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    lag)
      # SFI's refresh in order (--sfi-async-lag 0, the default) against the asynchronous one
      # (lag 4), alternated LAG_REPS times (1 2), at batch 1 and SB (6), CTX_SB (128k); budget and interval
      # as in `sfi`
      for rep in ${LAG_REPS:-1 2}; do
        for lag in 0 4; do
          for b in 1 "${SB:-6}"; do
            echo "== rep $rep lag $lag batch $b" | tee -a "$OUT/lag.log"
            .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX_SB:-128k}" \
              --batch $b --new-tokens "$N" --policies sfi $SFI_OPTS --sfi-async-lag $lag \
              --json "$OUT/lag$lag-b$b-r$rep.json" 2>&1 | tee -a "$OUT/lag.log"
          done
        done
      done ;;
    sfi-ab)
      # SFI at batch SB (default 6) and CTX_SB (default 128k) under each of SFI_CFGS
      # (VAR=value settings, several joined by commas, e.g. "SLOWFAST_GEMV_MMA_ROWS=0
      # SLOWFAST_GEMV_MMA_ROWS=8,SLOWFAST_SPARSE_POST=1"); SFI_POLICIES (default full,sfi)
      SFI_ARGS="--policies ${SFI_POLICIES:-full,sfi} $SFI_OPTS"
      for cfg in ${SFI_CFGS:-SLOWFAST_GEMV_MMA_ROWS=0 SLOWFAST_GEMV_MMA_ROWS=8}; do
        echo "== $cfg" | tee -a "$OUT/sfi-ab.log"
        env ${cfg//,/ } .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "${CTX_SB:-128k}" \
          --batch "${SB:-6}" --new-tokens "$N" $SFI_ARGS 2>&1 | tee -a "$OUT/sfi-ab.log"
      done ;;
    binab)
      # two builds side by side, alternated (old, new, old, new): .bin/slowfast_old (copy an
      # earlier .bin/slowfast there; gpu_test.sh keeps it) against .bin/slowfast, each compiling
      # its own kernels (the cache is keyed by source). AB_CTX (default 8k), AB_BATCH (1),
      # AB_POL (streaming,sfi); SFI budget and interval as `sfi`.
      for b in old new old new; do
        bin=.bin/slowfast
        [ "$b" = old ] && bin=.bin/slowfast_old
        echo "== $b" | tee -a "$OUT/binab.log"
        $bin bench --device cuda --model random:qwen3-4b --contexts "${AB_CTX:-8k}" --batch "${AB_BATCH:-1}" \
          --new-tokens "$N" --policies "${AB_POL:-streaming,sfi}" $SFI_OPTS 2>&1 | tee -a "$OUT/binab.log"
      done ;;
    serve)
      # `slowfast serve --device cuda` under load (issue 19) against `bench --batch` at the same
      # batch and context. SERVE_CFGS: BATCH:MAX_CONTEXT:PROMPT_TOKENS:POLICY[:SLOTS] entries
      # (MAX_CONTEXT must hold PROMPT_TOKENS + N, or max_tokens is cut and the load test fails);
      # one wave of BATCH streams of N tokens (token-id prompts, ignore_eos, SERVE_TEMP, default
      # 0: greedy like the bench), then a probe request's TTFT while they decode (it waits for a
      # slot unless SLOTS > BATCH); SERVE_GRAPHS (default 1) sets SLOWFAST_SERVE_GRAPHS.
      for cfg in ${SERVE_CFGS:-6:131072:126976:full 6:131072:126976:sfi 32:8704:7936:full:33 32:8704:7936:sfi:33}; do
        IFS=: read -r B C P POL S <<< "$cfg"
        opts=""; [ "$POL" = full ] || opts="$SFI_OPTS"
        log="$OUT/serve-$POL-b$B-$P.log"
        echo "== serve $cfg" | tee -a "$OUT/serve.log"
        SLOWFAST_SERVE_GRAPHS="${SERVE_GRAPHS:-1}" .bin/slowfast serve --device cuda --model random:qwen3-4b \
          --max-batch "${S:-$B}" --max-context "$C" --max-queue 256 --max-body-bytes 67108864 --port 0 \
          --policy "$POL" $opts > "$log" 2>&1 &
        spid=$!
        url="$(serve_url "$log" "$spid")"
        if [ -z "$url" ]; then tail -20 "$log" | tee -a "$OUT/serve.log"; rc=1; continue; fi
        python3 .bin/serve_load.py --url "$url" --token-ids --vocab 151936 --concurrency "$B" --requests "$B" \
          --max-tokens "$N" --prompt-lengths "$P" --ignore-eos --disconnect-fraction 0 --probe "${PROBE:-512}" \
          --temperature "${SERVE_TEMP:-0}" \
          --timeout 1800 --settle-timeout 30 --json "$OUT/serve-$POL-b$B-$P.json" 2>&1 | tee -a "$OUT/serve.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        kill $spid; wait $spid 2>/dev/null
        tail -3 "$log" >> "$OUT/serve.log"
        .bin/slowfast bench --device cuda --model random:qwen3-4b --contexts "$P" --batch "$B" \
          --new-tokens "$N" --policies "$POL" $opts --json "$OUT/serve-bench-$POL-b$B-$P.json" 2>&1 | tee -a "$OUT/serve.log"
      done ;;
    faults)
      # the fault storm (tests/serve/fault_storm.py: disconnects mid-prefill / mid-stream /
      # abandoned, concurrent cancels, bad bodies, 1,000 idle connections, slowloris) against
      # `serve --device cuda`; after it /metrics must be idle and GPU memory.used back to its
      # value after warm-up (FAULT_MEM_TOL MiB of slack, default 0). FAULT_MODEL (default
      # random:qwen3-4b, token-id prompts of FAULT_VOCAB 151936), FAULT_CTX (default 2048).
      log="$OUT/faults-serve.log"
      ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
      SLOWFAST_SERVE_GRAPHS="${SERVE_GRAPHS:-1}" .bin/slowfast serve --device cuda --model "${FAULT_MODEL:-random:qwen3-4b}" \
        --max-batch 8 --max-context "${FAULT_CTX:-2048}" --max-queue 256 --max-body-bytes 1048576 --port 0 \
        --header-read-timeout 10 --body-read-timeout 5 > "$log" 2>&1 &
      spid=$!
      url="$(serve_url "$log" "$spid")"
      if [ -z "$url" ]; then tail -20 "$log" | tee -a "$OUT/faults.log"; rc=1; continue; fi
      timeout -k 10 "${FAULT_TIMEOUT:-540}" python3 tests/serve/fault_storm.py --url "$url" --token-ids "${FAULT_VOCAB:-151936}" \
        --max-body-bytes 1048576 --header-read-timeout 10 --body-read-timeout 5 \
        --nvidia-smi --gpu-mem-tolerance-mib "${FAULT_MEM_TOL:-0}" 2>&1 | tee -a "$OUT/faults.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      kill -0 $spid 2>/dev/null || { echo "the server died during the storm" | tee -a "$OUT/faults.log"; rc=1; }
      kill $spid; wait $spid 2>/dev/null
      tail -5 "$log" >> "$OUT/faults.log" ;;
    torch)
      python3 .bin/torch_reference.py --contexts "$CTX" --new-tokens "$N" --json "$OUT/torch.json" 2>&1 | tee "$OUT/torch.log" ;;
    gen)
      .bin/slowfast generate --device cuda --model .bin/fixtures/hf/qwen3 -p "The miller" -n 16 --temperature 0 2>&1 | tee "$OUT/generate.log"
      .bin/slowfast generate --device cpu --model .bin/fixtures/hf/qwen3 -p "The miller" -n 16 --temperature 0 2>&1 | tee -a "$OUT/generate.log" ;;
  esac
done
exit $rc
