#!/usr/bin/env bash
# Issue 23's measurements on a lent GPU in one call of the device tool (run from the repo root, `.whl` carried
# with the gguf wheel, pytest-xdist's and execnet's (the tests' processes), and for `serve` those of fastapi,
# uvicorn and httpx with their dependencies: pip download fastapi uvicorn httpx pytest-xdist --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 -d .whl): the
# CUDA tests, then the blocks precision on synthetic weights of the real shapes
# (Q4_K_M's mix of Q4_K and Q6_K): the kernels, a step eager and from CUDA graphs, jllm bench for the 1.5B
# target and a Qwen3-4B (the origin document's), each log under $OUT.
#   bash benchmarks/cuda_lease.sh [tests] [matvec] [profile] [bench] [4b]      (none: all of them)
# llamacpp: llama.cpp's llama-bench built with CUDA from .xfer/lcpp.tar.xz (a trimmed copy of the source that
# ../shared/tools/build_llamacpp.sh fetches: benchmarks/llamacpp_cuda_src.sh makes it; carry it), in the
# background and niced from the start, then run on the same synthetic file at the end (a later call with
# `llamacpp` alone waits for a build still running).
# With matvec, the sweep's best setting for each shape goes to $OUT/best.json, and profile, bench and 4b then run
# under it (benchmarks/cuda_tuned.py) rather than under jllm.cuda.matvec.setting's.
# MODEL=FILE: a real target instead of the synthetic one (sent in pieces: training/gpu.sh recv/setup put it in
# /tmp/m/t.gguf); HEAD=FILE: its EAGLE-3 head, for
#   spec     jllm bench --spec on the corpus with the head, on the GPU
#   serve    benchmarks/serve_load.py against `jllm serve --device cuda` with the head
#   loop     benchmarks/spec_loop_costs.py on the GPU: each pass's time in the speculative loop (the head's draft
#            step and the host's share a round: what a round on the device would save)
# rounds: jllm bench --spec with rounds on the device (jllm.cuda.rounds) once per ROUNDS value (JLLM_CUDA_ROUNDS,
# drafts a round; 0: the host-driven loop), with HEAD, or without it a random head of the real shape made here
# (benchmarks/synthetic_head.py: its drafts almost all wrong, so a round's tokens/s against plain is about its
# cost in steps; the rounds' accepted count says how far from all wrong).
# spec runs once per ROUNDS value too.
# roundprof: benchmarks/cuda_round_profile.py once per kernel choice and ROUNDS value (0 read as 3): a round's graph
# against a decode step, a verify pass and the head's passes, and an eager round's kernels by part.
# ROWS="8 1": bench and spec once per JLLM_MATVEC_ROWS value (rows of x a matvec program; 1: a program a row).
# MMA="0 1 dp4a": tests, profile, bench and spec once per kernel choice (`kern` below: 1 the tensor-core
# kernels, jllm.cuda.mma; q4_k: Q4_K's only, Q6_K's on the float kernels; dp4a: int8 x and dp4a,
# jllm.cuda.dp4a, dp4a:q4_k for Q4_K's only; imma: dp4a with its passes of several rows on the int8 tensor cores,
# jllm.cuda.imma). The next lease after session 29, in this order:
#   MMA="0 dp4a" bash benchmarks/cuda_lease.sh dp4a bench profile   (the dp4a sweep's best settings feed bench and
#                       profile; the norm's and the GLU's x preparation now spread over a program a super-block)
#   MMA="dp4a" ROUNDS="0 3" bash benchmarks/cuda_lease.sh rounds    (a round's cost with a random head)
#   then the real model and head: MODEL=... HEAD=... MMA="0 dp4a" ROUNDS="0 3" ... spec llamacpp
#   (benchmarks/lease_bg.sh runs these as background jobs, one after another, while the calls that carry the
#   target's pieces go on: its header lists the calls)
# mma: the matvec sweep of the tensor-core kernels (outputs a program, shares of a row) at 1, 4 and 16 rows,
# beside the CUDA-core kernels at their settings.
# dp4a: the same sweep of the dp4a kernels (int8 x, jllm.cuda.dp4a) at 1, 4 and 8 rows; its best setting for
# each shape goes to $OUT/best_dp4a.json, which profile and bench then run dp4a choices under.
# build: only start llama.cpp's build (from the first call, so that it is done when `llamacpp` runs).
# trainstep: issue 26's training step (jllm.train.head) on the synthetic target: its log's step times and
# profile table, with --compile too, beside an earlier training package's if .xfer/train_old/ is carried (below).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1   # gguf; serve: fastapi, uvicorn, httpx
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
want() { [ $# -eq 0 ] || [[ " $ARGS " == *" $1 "* ]]; }
ARGS="$*"
# triton39: the image's Triton is 3.6, whose compiler stores the tensor-core kernels' f16 tiles to shared memory
# 16 bits at a time (Q4_K 4.98 instructions a weight, Q6_K 10.3, against 3.85 and 6.75 from Triton 3.9, by
# benchmarks/cuda_sass.py with each). 3.9's wheel (286 MB) travels in 5 pieces of 56 MiB (the head and the data
# moved out of the tree, as for the target's pieces): here
#   split -b 56M -d -a 1 triton-3.9.0-cp312-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl .xfer/tw
# then 5 calls of `bash training/gpu.sh keep twN` carrying .xfer/twN, then this script's `triton39` step (in the
# next call), which joins, checks and installs it under /tmp/t39; every later call then runs under it.
TRITON39_SHA=5e52ab4e2f1d64f0ac494c9aa723697b793f81a91c4cae4c36608ca0bc4267bf
if want triton39; then
  W=/tmp/triton-3.9.0-cp312-abi3-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
  cat /tmp/m/tw? > $W && echo "$TRITON39_SHA  $W" | sha256sum -c - || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/t39 $W || exit 1
  rm -f /tmp/m/tw? $W
fi
[ -d /tmp/t39/triton ] && export PYTHONPATH="$PWD/src:/tmp/t39:/tmp/site"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
S15=${MODEL:-/tmp/s15.gguf}
TAG=${TAG:-s15}
ROWS=${ROWS:-8}
MMA=${MMA:-0}
ROUNDS=${ROUNDS:-0}
# a kernel choice, one of MMA's values -> its settings: 0 (the float kernels), 1 / q4_k / q6_k (the tensor cores
# for those block types), dp4a / dp4a:q4_k / dp4a:q6_k (int8 x and dp4a, jllm.cuda.dp4a)
kern() { case $1 in dp4a) echo JLLM_MATVEC_MMA=0 JLLM_MATVEC_DP4A=1;; imma) echo JLLM_MATVEC_MMA=0 JLLM_MATVEC_DP4A=1 JLLM_MATVEC_IMMA=1;; dp4a:*) echo JLLM_MATVEC_MMA=0 JLLM_MATVEC_DP4A=${1#dp4a:};;
  *) echo JLLM_MATVEC_MMA=$1 JLLM_MATVEC_DP4A=0;; esac; }
[ -n "${MODEL:-}" ] || [ -f $S15 ] || python3 benchmarks/synthetic_gguf.py $S15 --shape qwen2.5-1.5b --dtype q4_k_m
LB=/tmp/lcpp/build/bin/llama-bench
if { want llamacpp || want build; } && [ ! -x $LB ] && [ ! -f /tmp/lcpp/started ] && [ -f .xfer/lcpp.tar.xz ]; then
  mkdir -p /tmp/lcpp && tar xJf .xfer/lcpp.tar.xz -C /tmp/lcpp && touch /tmp/lcpp/started
  setsid nohup nice -n 19 bash -c "cmake -S /tmp/lcpp/llama.cpp -B /tmp/lcpp/build -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF && \
    cmake --build /tmp/lcpp/build -j 14 --target llama-bench" > /tmp/lcpp/build.log 2>&1 &
fi
# the tests compile their Triton kernels first (session 32: over 9.5 minutes of one H100 for one kernel choice
# on a cold machine, one process), so they run in PAR processes (pytest-xdist, carried in .whl) where it is there
PAR=${PAR:-8}
XDIST=; python3 -c "import xdist" 2>/dev/null && [ "$PAR" -gt 1 ] && XDIST="-n $PAR"
if [ -z "$ARGS" ] || want tests; then
  for t in $MMA; do
    env $(kern $t) python3 -m pytest -q --tb=line $XDIST tests/test_cuda.py tests/test_cuda_matvec.py \
      tests/test_cuda_attention.py tests/test_cuda_fused.py tests/test_cuda_head.py tests/test_cuda_ptx.py tests/test_cuda_rounds.py tests/test_cuda_dp4a.py tests/test_cuda_imma.py tests/test_verify.py 2>&1 \
      | tee "$OUT/tests_mma${t/:/-}.log" | tail -25
  done
fi
if [ -z "$ARGS" ] || want matvec; then
  python3 benchmarks/cuda_matvec.py --rows 1 --block-n 8 16 --sb 1 2 --split 1 5 7 --stages 1 3 --reps 50 \
    --best "$OUT/best.json" 2>&1 | tee "$OUT/matvec.log"
fi
if want mma; then
  JLLM_MATVEC_MMA=1 python3 benchmarks/cuda_matvec.py --rows 1 4 16 --block-n 32 64 128 --sb 1 --split 1 3 6 \
    --short-split --reps 50 --all 2>&1 | tee "$OUT/matvec_mma.log"
  python3 benchmarks/cuda_matvec.py --rows 1 4 16 --block-n 8 16 --sb 1 2 --split 1 5 --reps 50 2>&1 \
    | tee "$OUT/matvec_cores.log"
fi
if want dp4a; then                    # the dp4a kernels' sweep (jllm.cuda.dp4a) at decode's and verify's rows
  # a narrow grid: each setting is a compile of a few seconds, and session 33's wide one (4 x 2 x 3 settings at
  # 1, 4 and 8 rows) spent 12 minutes on the three smallest shapes, whose best was block_n 16, sb 2, split 3 at
  # every row count (results/s33/matvec_dp4a.log)
  JLLM_MATVEC_MMA=0 JLLM_MATVEC_DP4A=1 python3 benchmarks/cuda_matvec.py --rows 1 4 --block-n 16 32 \
    --sb 2 --split 1 3 --short-split --reps 50 --all --best "$OUT/best_dp4a.json" 2>&1 | tee "$OUT/matvec_dp4a.log"
fi
RUN="python3 benchmarks/cuda_tuned.py $OUT/best.json"
[ -f "$OUT/best.json" ] || RUN="python3 benchmarks/cuda_tuned.py /dev/null"
RUN_DP4A="python3 benchmarks/cuda_tuned.py $OUT/best_dp4a.json"      # the dp4a sweep's choice, for dp4a runs
[ -f "$OUT/best_dp4a.json" ] || RUN_DP4A="python3 benchmarks/cuda_tuned.py /dev/null"
runner() { case $1 in dp4a*) echo "$RUN_DP4A";; *) echo "$RUN";; esac; }
if [ -z "$ARGS" ] || want profile; then
  for t in $MMA; do
    env $(kern $t) $(runner $t) --script benchmarks/cuda_profile.py $S15 --rows 1 4 2>&1 | tee "$OUT/profile_mma${t/:/-}.log"
  done
fi
if [ -z "$ARGS" ] || want bench; then
  for t in $MMA; do for r in $ROWS; do
    env $(kern $t) JLLM_MATVEC_ROWS=$r $(runner $t) bench -m $S15 --device cuda --precision blocks \
      --json "$OUT/bench_${TAG}_r${r}_mma${t/:/-}.json" 2>&1 | tee "$OUT/bench_${TAG}_r${r}_mma${t/:/-}.log"
  done; done
fi
if want spec || want serve || want loop; then
  : "${HEAD:?spec and serve need HEAD=the head file}"
fi
if want spec; then
  for t in $MMA; do for r in $ROWS; do for q in $ROUNDS; do
    env $(kern $t) JLLM_MATVEC_ROWS=$r JLLM_CUDA_ROUNDS=$q python3 -m jllm bench --spec -m $S15 -md "$HEAD" \
      --device cuda --precision blocks -n 128 --json "$OUT/spec_${TAG}_r${r}_mma${t/:/-}_k$q.json" 2>&1 \
      | tee "$OUT/spec_${TAG}_r${r}_mma${t/:/-}_k$q.log" | tail -16
  done; done; done
fi
if want rounds; then                  # a round's cost: a random head unless HEAD is given
  H=${HEAD:-/tmp/h15.gguf}
  [ -f "$H" ] || python3 benchmarks/synthetic_head.py $S15 "$H" || exit 1
  for t in $MMA; do for q in $ROUNDS; do     # the rounds alone (no gate), then as the engine runs them
    for g in 0 1; do
      env $(kern $t) JLLM_CUDA_ROUNDS=$q JLLM_CUDA_ROUND_GATE=$g python3 -m jllm bench --spec -m $S15 \
        -md "$H" --device cuda --precision blocks -n 64 --json "$OUT/rounds_${TAG}_mma${t/:/-}_k${q}_g$g.json" 2>&1 \
        | tee "$OUT/rounds_${TAG}_mma${t/:/-}_k${q}_g$g.log" | tail -4
      [ "$q" = 0 ] && break
    done
  done; done
fi
if want roundprof; then               # where a round's time goes (a random head unless HEAD is given), per kernel choice
  H=${HEAD:-/tmp/h15.gguf}
  [ -f "$H" ] || python3 benchmarks/synthetic_head.py $S15 "$H" || exit 1
  # ROUNDS' 0 (the host's loop) means nothing here: read as the default round, 3, once
  for t in $MMA; do for q in $(for v in $ROUNDS; do [ "$v" = 0 ] && echo 3 || echo "$v"; done | sort -un); do
    env $(kern $t) python3 benchmarks/cuda_round_profile.py $S15 "$H" -k $q 2>&1 \
      | tee "$OUT/roundprof_${TAG}_mma${t/:/-}_k$q.log"
  done; done
fi
if want loop; then                    # per pass inside the speculative loop: the head's step and the host's share
  python3 benchmarks/spec_loop_costs.py -m $S15 -md "$HEAD" --device cuda --precision blocks --every 3 -n 128 \
    2>&1 | tee "$OUT/spec_loop_$TAG.log"
fi
if want serve; then
  python3 benchmarks/serve_load.py -m $S15 --requests 64 --concurrency 4 --max-tokens 64 \
    --server-args "-md $HEAD --device cuda --precision blocks" --json "$OUT/serve_$TAG.json" 2>&1 \
    | tee "$OUT/serve_$TAG.log"
fi
if want trainstep; then              # issue 26: the head's training step on the 1.5B's shapes, no transfer
  # data made here by the synthetic target (random replies, each token its own byte of the prompt: longer
  # rows than real chat, so a step's attention is, if anything, dearer), then 60 steps of the shipped head's
  # shape with three under torch's profiler; with .xfer/train_old/ carried (an earlier src/jllm/train, the one
  # the last training lease ran: `git archive 6fecc5c src/jllm/train | tar x -C /tmp` and its *.py copied
  # there), the same steps under it too, for the two steps' times side by side
  TS="--draft-vocab 28672 --ffn 2304 --ttt 7 --qtype Q4_0 --holdout 0 --steps 60 --profile 3"
  python3 -m jllm.train.head -m $S15 -o /tmp/h_syn.gguf --device cuda --data /tmp/syn_conv.npz --magpie 64 \
    --package 512 --writing 0 --questions 0 --requests 0 --gen-batch 576 --max-new 512 --gen-time 60 --data-only \
    2>&1 | tee "$OUT/trainstep_data.log" | tail -3
  train_steps() {                    # $1: the log under $OUT; then more train-head arguments
    local log=$1; shift
    python3 -m jllm.train.head -m $S15 -o /tmp/h_syn.gguf --device cuda --data /tmp/syn_conv.npz $TS "$@" 2>&1 \
      | tee "$OUT/$log" | grep -E "^step (1|60)/|wrote"
  }
  train_steps trainstep.log
  train_steps trainstep_compile.log --compile      # the head's step through torch.compile (its first steps compile)
  if [ -d .xfer/train_old ]; then
    rm -rf /tmp/old_src && cp -r src /tmp/old_src && rm -rf /tmp/old_src/jllm/train && cp -r .xfer/train_old /tmp/old_src/jllm/train
    PYTHONPATH="/tmp/old_src:${PYTHONPATH#*:}" train_steps trainstep_old.log
  fi
fi
if [ -z "$ARGS" ] || want 4b; then
  S4=/tmp/s4b.gguf
  [ -f $S4 ] || python3 benchmarks/synthetic_gguf.py $S4 --shape qwen3-4b --dtype q4_k_m
  python3 -m jllm plan -m $S4 --device cuda --precision blocks -c 4096 2>&1 | tee "$OUT/plan_4b.log"
  $RUN bench -m $S4 --device cuda --precision blocks -c 4096 --json "$OUT/bench_4b.json" 2>&1 \
    | tee "$OUT/bench_4b.log"
fi
if want llamacpp && [ -f /tmp/lcpp/started ]; then
  until [ -x $LB ] || ! pgrep -f "cmake --build /tmp/lcpp" > /dev/null; do sleep 5; done
  cp /tmp/lcpp/build.log "$OUT/llamacpp_build.log"; grep -i -B2 -A3 'error' /tmp/lcpp/build.log | head -30; tail -3 /tmp/lcpp/build.log
  if [ -x $LB ]; then
    for fa in 0 1; do
      $LB -m $S15 -ngl 99 -p 512 -n 128 -r 5 -fa $fa -o md 2>&1 | tee -a "$OUT/llamacpp.log" | grep -v "^$"
    done
  fi
fi
