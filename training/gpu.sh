#!/usr/bin/env bash
# The head's training run on a lent GPU machine (the device tool), one phase per call; run from the repo root.
# The target arrives in pieces, one per call: a call carries at most 64 MiB with the working tree. Without the
# shipped head (src/jllm/heads/, 40 MiB) and the training data (training/qwen2.5-coder-1.5b/, 20 MiB) the tracked
# tree is ~6 MiB, so move both out while the pieces travel and cut 56 MiB pieces (20 calls for the 1.5B, against
# 29 of 38 MiB with the data in the tree):
#     mkdir -p /tmp/away && mv src/jllm/heads/*.gguf training/qwen2.5-coder-1.5b/*.npz /tmp/away/
#     split -b 56M -d -a 2 TARGET.gguf .xfer/p                       # p00-p19, each sent by `recv NN`
# then put the data back for `start` (`git checkout training/`; it travels with that call, the head stays out).
# Files in /tmp/m stay while the machine is warm: the next call must start < 30 s after one ends, the second
# one too (the cold start's call is no exception).
#   recv NN                 keep piece .xfer/pNN
#   keep FILE               keep .xfer/FILE as $M/FILE (e.g. a head to start from: --init /tmp/m/init.gguf, sent
#                           in a call of its own, with the data out of the tree)
#   setup SHA256            join the pieces, check the sum, install the carried gguf wheel (.whl/)
#   start GEN_S STEPS PROCS [TRAIN ARGS...]
#                           in a new process session: PROCS data makers (seeds SEED_BASE+1.., GEN_S seconds
#                           of replies each; GEN_ARGS: their sources and batch), then training on the data in
#                           the repo and theirs, STEPS steps (0: none, the data alone); REPO_DATA=0: on theirs
#                           alone (a run from scratch)
#   poll                    the logs' last lines; and into $OUT, each once it is whole, what `back` gives: a
#                           machine lost between two calls (a turn that came late) then loses only what came after
#   back                    the head (15 MiB parts), the new data and the logs into $OUT
set -euo pipefail
M=/tmp/m
mkdir -p "$M"
export PYTHONPATH="$PWD/src:$M/site" PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
DATA=training/qwen2.5-coder-1.5b/conversations-*.npz
back_out() {
    # at most 8 files come back; the logs still grow (tar's status 1: a file changed as it was read)
    tar -C "$M" -czf "$OUT/logs.tgz" --warning=no-file-changed $(cd "$M" && ls *.log) || [ $? -eq 1 ]
    for f in "$M"/conv-s*.npz; do [ -f "$f" ] && cp "$f" "$OUT/"; done
    if [ -f "$M/head.gguf" ]; then                    # one file for the sum and the parts: a checkpoint may land
        ln -f "$M/head.gguf" "$M/head.snap"
        sha256sum "$M/head.snap"; split -b 15M -d -a 1 "$M/head.snap" "$OUT/head.part"
    fi
    ls -l "$OUT"
}
case "$1" in
recv)
    cp ".xfer/p$2" "$M/" && ls -l "$M/p$2" ;;
keep)
    cp ".xfer/$2" "$M/$2" && sha256sum "$M/$2" ;;
setup)
    # the pieces stay until the sum is right: a piece lost with a machine that went cold is sent again. A target
    # already joined and right is kept: a second setup (session 33: a call repeated for a missing wheel) joined
    # no pieces into it and emptied it, and the 20 pieces had to travel again
    if ! { [ -s "$M/t.gguf" ] && echo "$2  $M/t.gguf" | sha256sum -c --quiet - >/dev/null 2>&1; }; then
        ls "$M"/p?? > /dev/null 2>&1 || { echo "no pieces in $M and no target there: recv them first" >&2; exit 1; }
        cat "$M"/p?? > "$M/t.gguf"
        echo "$2  $M/t.gguf" | sha256sum -c - || { echo "pieces here: $(cd "$M" && ls p?? | paste -sd' ')" >&2; exit 1; }
        rm -f "$M"/p??
    fi
    [ -n "$(ls .whl/gguf-*.whl 2>/dev/null)" ] || { echo "carry .whl (the gguf wheel) with setup" >&2; exit 1; }
    python3 -m pip install -q --no-deps --target "$M/site" .whl/gguf-*.whl
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv ;;
start)
    gen_s=$2 steps=$3 procs=$4; shift 4
    rm -rf "$M/src" "$M/data" && cp -r src "$M/src" && mkdir "$M/data"     # later calls may change the tree
    rm -f "$M/finished" "$M/train.log" "$M/head.gguf" "$M/head.snap"       # an earlier job's: poll reads them
    [ "${REPO_DATA:-1}" = 0 ] || cp $DATA "$M/data/"
    cat > "$M/job.sh" <<EOF
set -x
export PYTHONPATH=$M/src:$M/site
echo "job start \$(date +%s)"
for i in \$(seq 1 $procs); do
  s=\$((i + \${SEED_BASE:-3}))
  python3 -m jllm.train.head -m $M/t.gguf -o $M/unused.gguf --device cuda --data $M/conv-s\$s.npz --data-only \
    \${GEN_ARGS:---magpie 3000 --package 8000 --writing 6000 --gen-batch 768} --max-new 512 --gen-time $gen_s \
    --seed \$s > $M/gen\$s.log 2>&1 &
done
wait
files=
for f in $M/data/*.npz $M/conv-s*.npz; do [ -f \$f ] && files=\${files:+\$files,}\$f; done
echo "training on \$files"
[ $steps = 0 ] || python3 -m jllm.train.head -m $M/t.gguf -o $M/head.gguf --device cuda --data \$files --steps $steps $* \
  > $M/train.log 2>&1
echo "job end \$(date +%s)"
echo done > $M/finished
EOF
    setsid bash "$M/job.sh" > "$M/job.log" 2>&1 < /dev/null &
    sleep 2; cat "$M/job.log" ;;
poll)
    for f in "$M"/gen*.log "$M"/train.log; do [ -f "$f" ] && { echo "== $f"; tail -n "${2:-3}" "$f"; }; done
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader || true
    # the data makers have all ended once training has begun (or the job has); a head is renamed in whole
    if [ -f "$M/train.log" ] || [ -f "$M/finished" ]; then back_out; fi
    [ -f "$M/finished" ] && echo FINISHED || true ;;
back)
    back_out ;;
*)
    echo "unknown phase $1" >&2; exit 2 ;;
esac
