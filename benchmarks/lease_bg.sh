#!/usr/bin/env bash
# A lease's GPU work as background jobs, one after another, so that the device calls which carry the target's
# pieces (56 MiB each, ~7 s a call) run while the GPU measures: the synthetic runs need no transfer, and the
# real model's runs queue behind them. Run from the repo root on the device machine.
#   start NAME [VAR=VALUE ...] -- CMD ...
#           queue CMD (with those variables) behind the jobs already queued, in a copy of the working tree taken
#           now (a later call's tree does not change it), and return at once; CMD runs under setsid, so the call
#           that queued it may end. Every job's OUT is the one folder $L/out: what a job writes there (say the
#           dp4a sweep's best_dp4a.json) the jobs after it read.
#   poll [LINES]
#           each job's state (queued, running, done with its exit status) and its log's last LINES lines (3), and
#           into the call's $OUT one archive, bg.tgz: $L/out and the jobs' logs (what a machine that goes back
#           between two calls would otherwise lose).
#   wait [SECONDS]
#           poll every 5 s until every job has ended or SECONDS (500) have passed, then poll once more.
# L is /tmp/L unless LEASE_DIR says otherwise (the tests run it on the CPU with a fake command).
# Session 33 ran this plan (BENCHMARKS.md, "Session 33 on the GPU"): tests pass under both kernel families, the real
# model decodes at 1.10x llama.cpp; rounds with the head gain nothing (0.95x) until verify rows are near free at
# the CUDA cores' one-row speed, which needs kernel work first (jllm.cuda.imma's note). Until that exists, a lease
# is better spent on issue 26's training (training/README.md: --init from the shipped head); the dp4a sweep alone
# took over 12 minutes there (now narrower), and a second `gpu.sh setup` emptied the joined target (now kept).
# The next lease, in this order (~25 minutes): `lease_bg.sh start ts -- bash benchmarks/cuda_lease.sh trainstep`
# (train-head --compile against eager on the synthetic target, no transfer), the 20 pieces and `gpu.sh keep
# init.gguf`, then `gpu.sh setup SHA` and `lease_bg.sh start rp MODEL=/tmp/m/t.gguf HEAD=/tmp/m/init.gguf TAG=real
# MMA="0 dp4a" ROUNDS=3 -- bash benchmarks/cuda_lease.sh roundprof` (where a round's time goes, ~3 minutes), then,
# once both are done, training/README.md's "Session 33: the next run" (with --compile if trainstep says it pays).
# The calls for issue 23 (benchmarks/cuda_lease.sh's header says what each step measures):
#   1. carry .whl, .xfer/lcpp.tar.xz and .xfer/train_old (issue 26's training step before and after a change):
#      bash benchmarks/lease_bg.sh start syn MMA="0 dp4a" -- bash benchmarks/cuda_lease.sh build tests dp4a profile \
#        bench trainstep
#      (tests first: session 30 rewrote every matvec kernel's row dispatch, checked by offline SASS and the
#      interpreter only; a failure there voids what follows, so poll it before the pieces are all sent. Session
#      32's lease ran 147 of them under MMA=0, all passed, in 570 s of one process: carry pytest-xdist and
#      execnet in .whl, which cuda_lease.sh then uses for 8 processes)
#   2. 20 calls, each carrying one piece (training/gpu.sh's header): bash training/gpu.sh recv NN && bash
#      benchmarks/lease_bg.sh poll 1
#   3. carrying .xfer/init.gguf (the head): bash training/gpu.sh keep init.gguf && bash training/gpu.sh setup SHA &&
#      bash benchmarks/lease_bg.sh start real MODEL=/tmp/m/t.gguf HEAD=/tmp/m/init.gguf TAG=real MMA="0 dp4a" \
#        ROUNDS="0 3" -- bash benchmarks/cuda_lease.sh bench spec llamacpp && bash benchmarks/lease_bg.sh wait 500
#   4. bash benchmarks/lease_bg.sh wait 500, until every job is done.
set -uo pipefail
L=${LEASE_DIR:-/tmp/L}
mkdir -p "$L/out" "$L/jobs"

state() {          # one job's state from its files
    local j=$1
    if [ -f "$j/rc" ]; then echo "done rc=$(cat "$j/rc")"
    elif [ -f "$j/began" ]; then echo "running $(( $(date +%s) - $(cat "$j/began") )) s"
    else echo queued; fi
}

poll() {
    local n=${1:-3} j
    for j in $(ls -d "$L"/jobs/*/ 2>/dev/null | sort); do
        j=${j%/}
        echo "== ${j##*/}: $(state "$j")"
        [ -f "$j/log" ] && tail -n "$n" "$j/log"
    done
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
        tar -C "$L" -czf "$OUT/bg.tgz" --warning=no-file-changed out $(cd "$L" && ls jobs/*/log 2>/dev/null) \
            || [ $? -eq 1 ]
    fi
}

case "${1:-}" in
start)
    name=${2:?start needs a name}; shift 2
    vars=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do vars+=("$1"); shift; done
    [ "${1:-}" = -- ] || { echo "start NAME [VAR=VALUE ...] -- CMD ..." >&2; exit 2; }
    shift
    [ $# -gt 0 ] || { echo "start: no command" >&2; exit 2; }
    n=$(ls "$L/jobs" | wc -l)
    j=$L/jobs/$(printf '%02d' "$n")-$name
    mkdir -p "$j/repo"
    tar --exclude=./.git --exclude='./.xfer/p[0-9][0-9]' -cf - . | tar -C "$j/repo" -xf -
    prev=
    [ "$n" -gt 0 ] && prev=$(ls -d "$L"/jobs/$(printf '%02d' $((n - 1)))-*)
    {   # the job: wait for the one queued before it (one job on the GPU at a time, in order), then run
        echo "cd $(printf '%q' "$j/repo") || exit 1"
        [ -n "$prev" ] && echo "until [ -f $(printf '%q' "$prev/rc") ]; do sleep 2; done"
        echo "date +%s > $(printf '%q' "$j/began")"
        printf 'env '; printf '%q ' "${vars[@]}" "OUT=$L/out" "$@"
        echo "> $(printf '%q' "$j/log") 2>&1 < /dev/null"
        echo "echo \$? > $(printf '%q' "$j/rc")"
    } > "$j/run.sh"
    printf '%q ' "${vars[@]}" "$@" > "$j/cmd"
    setsid bash "$j/run.sh" > /dev/null 2>&1 < /dev/null &
    echo "queued ${j##*/}: $(cat "$j/cmd")" ;;
poll)
    poll "${2:-3}" ;;
wait)
    limit=${2:-500}; t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
        busy=0
        for j in "$L"/jobs/*/; do [ -d "$j" ] && [ ! -f "$j/rc" ] && busy=1; done
        [ $busy = 0 ] && break
        sleep 5
    done
    poll 12 ;;
*)
    echo "usage: lease_bg.sh start NAME [VAR=VALUE ...] -- CMD ... | poll [LINES] | wait [SECONDS]" >&2; exit 2 ;;
esac
