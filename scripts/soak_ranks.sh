#!/bin/bash
# Run multi-rank tests many times beside CPU burners, to find hangs and teardown races that a quiet machine hides.
#
#   scripts/soak_ranks.sh RUNS BURNERS [pytest arguments...]
#   scripts/soak_ranks.sh 20 2 tests/distributed/test_ddp.py tests/distributed/test_fsdp.py
#
# Each run is one pytest process under a hard limit (SOAK_LIMIT_S, default 900 s: far above a normal run, so reaching
# it means a hang); a line per run (exit status, seconds, pytest's summary, the load) goes to stdout. The burners are
# busy loops, one per requested CPU, stopped at the end. Exit status: 0 when every run passed.
set -u
runs=${1:?runs}
burners=${2:?burners}
shift 2
limit=${SOAK_LIMIT_S:-900}
pids=()
for _ in $(seq 1 "$burners"); do
    python -c "while True: pass" &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
failed=0
log=$(mktemp)
for run in $(seq 1 "$runs"); do
    start=$(date +%s)
    timeout "$limit" python -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
    status=$?
    [ "$status" -eq 0 ] || failed=$((failed + 1))
    echo "run $run/$runs: exit $status, $(($(date +%s) - start)) s, $(tail -1 "$log"), load $(cut -d' ' -f1-3 /proc/loadavg)"
    [ "$status" -eq 0 ] || tail -40 "$log"
done
rm -f "$log"
echo "$((runs - failed)) of $runs runs passed beside $burners burner(s)"
[ "$failed" -eq 0 ]
