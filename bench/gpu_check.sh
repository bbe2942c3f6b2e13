#!/usr/bin/env bash
# Device checks in one command, for a machine with one CUDA GPU (sized for an H200: at most 260 s
# of parts, so the whole fits a 5-minute call with start-up to spare):
#
#   bash bench/gpu_check.sh OUTDIR          # from anywhere; no install, no internet needed
#
# Parts, in order of value, each under its own `timeout` (limit in seconds); a part that fails or
# times out is recorded and the next one runs:
#   env       15  nvidia-smi, python / torch / CUDA versions, CUDA available?    -> env.json, gpu.csv
#   probe     15  python -m offload probe --json --refresh                       -> probe.json
#   step     110  python -m offload.bench --preset h200 (the 7B-class comparison) -> step/
#   predict   20  python bench/predict.py --part step: offload.predict of the step part's model and
#                 configurations (a named machine, the probe's link), beside what step measured -> predict.json
#   tests     60  python -m pytest -m cuda <the test files with cuda tests>        -> tests.xml
#   overhead  20  python bench/overhead.py --device cuda                          -> overhead.json
#   layers    20  python bench/layers.py --device cuda (the transfer/recompute fit) -> layers.json
# Each part is sized to fit its limit whatever the GPU's speed: step and overhead get a time limit of
# their own a few seconds short of the part's (--time-limit-s: a configuration, or an interleaved round,
# that would end past it is skipped and the part still reports), their engines share pinned slabs
# instead of pinning afresh, the tests part collects only the files with CUDA tests, and the probe is
# measured once (its cache under OUTDIR/cache, keyed by one intra-op thread in every part, the tests'
# setting). A timeout sends SIGINT first (-s INT), so pytest writes its XML and the scripts write what
# they measured; SIGKILL follows KILL_AFTER_S later.
# Each part leaves NAME.log and NAME.part.json (status, rc, seconds, limit) the moment it ends,
# and after each part summary.json and summary.md are rewritten whole (bench/gpu_summary.py:
# every part's status and key figures, hardware, versions, date; written to a temporary file and
# renamed, so a reader never sees one cut short).
#
# Without CUDA the GPU parts are skipped: exit 0 within seconds (1 if python / torch are broken),
# and summary.json says "cuda": false.
# Otherwise exit 0 when no part failed, 1 when one did.
#
# Knobs (environment): PYTHON (default python3), GPU_CHECK_DEVICE (default cuda; cpu runs every part
# on the CPU, the step part with the CPU demo preset, layers at tiny sizes), GPU_CHECK_QUICK=1 (tiny
# sizes: checks the plumbing, e.g. GPU_CHECK_DEVICE=cpu GPU_CHECK_QUICK=1 on a laptop),
# GPU_CHECK_STEP_ARGS (extra arguments for the step part, e.g. "--configs none,offload-25% --repeats 2").
set -u

OUT=${1:?usage: bash bench/gpu_check.sh OUTDIR}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)  # absolute, relative to where we were called from
cd "$(dirname "$0")/.." || exit 2

PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
QUICK=${GPU_CHECK_QUICK:-0}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # strict determinism on CUDA needs it
KILL_AFTER_S=5  # SIGKILL this long after the SIGINT of a timeout (pytest writes its XML meanwhile)
# One intra-op thread in every part: the probe's cache key names the thread count, and the tests run
# with one (tests/conftest.py), so with one everywhere the probe part's measurement serves the step
# part and the tests instead of each measuring again. The GPU parts do next to nothing on CPU threads;
# on the CPU (GPU_CHECK_DEVICE=cpu) one thread also keeps OpenMP from spin-waiting against other tenants.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export XDG_CACHE_HOME="$OUT/cache"  # the probe's cache: this run's own, and it comes back with OUTDIR
# The parts' own time limits. step's counts from its first configuration, after its start-up
# (imports, CUDA initialization, the probe's cache read), which the other 15 s of the part cover;
# overhead's from the script's start, 3 s short of the part's (its exit, a signal's delivery).
STEP_TIME_LIMIT_S=95
OVERHEAD_TIME_LIMIT_S=17

STEP_ARGS=(--preset h200 --time-limit-s "$STEP_TIME_LIMIT_S")
# The CPU cannot train the h200 shapes in a part's time: it runs the CPU demo preset, as much as fits.
[ "$DEVICE" = cpu ] && STEP_ARGS=(--preset demo --time-limit-s "$STEP_TIME_LIMIT_S")
OVERHEAD_ARGS=(--device "$DEVICE" --steps 10 --repeats 5 --warmup 1 --time-limit-s "$OVERHEAD_TIME_LIMIT_S")
LAYER_ARGS=(--device "$DEVICE")
# Nor the layers part its CPU sizes (about a minute on 2 cores): tiny ones (bench/layers.py has no time limit).
[ "$DEVICE" = cpu ] && LAYER_ARGS+=(--sizes tiny)
if [ "$QUICK" = 1 ]; then
    STEP_ARGS=(--preset tiny --in-process --time-limit-s "$STEP_TIME_LIMIT_S")
    OVERHEAD_ARGS+=(--steps 3 --repeats 3 --warmup 1 --chain 200 --batch 2)
    LAYER_ARGS+=(--sizes tiny)
fi
[ "$DEVICE" != cuda ] && STEP_ARGS+=(--device "$DEVICE")
# shellcheck disable=SC2206  # word splitting wanted: a list of extra arguments
STEP_ARGS+=(${GPU_CHECK_STEP_ARGS:-})

START_S=$SECONDS
FAILED=0

json_str() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr -d '\n')"; }

# The summary after every part: the python one, else (python broken) a plain one from the part files.
summarize() {
    if timeout -k 2 10 "$PY" bench/gpu_summary.py "$OUT" "$((SECONDS - START_S))" >/dev/null 2>"$OUT/summary.err"; then
        return
    fi
    local tmp="$OUT/.summary.json.tmp" first=1 f
    {
        printf '{"summary": "plain (bench/gpu_summary.py failed: see summary.err)", "cuda": %s, "seconds": %s, "parts": [' \
            "$([ -n "${CUDA_OK:-}" ] && echo true || echo false)" "$((SECONDS - START_S))"
        for f in "$OUT"/*.part.json; do
            [ -e "$f" ] || continue
            [ $first = 1 ] || printf ', '
            first=0
            cat "$f"
        done
        printf ']}\n'
    } >"$tmp" && mv "$tmp" "$OUT/summary.json"
    { echo "# offload device check (plain summary)"; echo; cat "$OUT"/*.part.json 2>/dev/null; } >"$OUT/summary.md"
}

# record NAME STATUS RC SECONDS LIMIT OUTPUT
record() {
    local tmp="$OUT/.$1.part.json.tmp"
    printf '{"part": "%s", "status": "%s", "rc": %s, "seconds": %s, "limit_s": %s, "output": %s}\n' \
        "$1" "$2" "$3" "$4" "$5" "$(json_str "$6")" >"$tmp" && mv "$tmp" "$OUT/$1.part.json"
    echo "[$1] $2 (rc $3, ${4}s, limit $5): $6"
    summarize
}

# run_part NAME LIMIT_S OUTPUT -- command...   (stdout+stderr go to OUTDIR/NAME.log)
# Exit status 5 is pytest's "no tests collected": recorded as such, not as a failure.
run_part() {
    local name=$1 limit=$2 output=$3 t0=$SECONDS rc status
    shift 4
    echo "[$name] running (limit ${limit}s): $*"
    timeout -s INT -k "$KILL_AFTER_S" "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout; FAILED=1 ;;
        5) status=no-tests ;;
        *) status=failed; FAILED=1 ;;
    esac
    tail -n 3 "$OUT/$name.log" | sed "s/^/[$name]   /"
    record "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" "$output"
}

skip_part() { record "$1" skipped null 0 null "$2"; }

# --- env -------------------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/gpu.csv" 2>&1
else
    echo "n/a (no nvidia-smi)" >"$OUT/gpu.csv"
fi
run_part env 15 env.json -- "$PY" -c '
import json, sys, torch
from offload.bench.measure import environment, write_json
cuda = torch.cuda.is_available()
env = environment(torch.device("cuda" if cuda and sys.argv[1] == "cuda" else "cpu")) | {"cuda": cuda}
write_json(sys.argv[2], env)
print(json.dumps(env))
' "$DEVICE" "$OUT/env.json"
if grep -q '"cuda": true' "$OUT/env.json" 2>/dev/null; then CUDA_OK=1; fi

if [ "$DEVICE" = cuda ] && [ -z "${CUDA_OK:-}" ]; then
    for part in probe step predict tests overhead layers; do skip_part "$part" "no CUDA device here (torch.cuda.is_available() is False)"; done
    echo "summary: $OUT/summary.md (no CUDA: GPU parts skipped, $((SECONDS - START_S))s)"
    exit "$FAILED"  # 0 unless the env part itself failed (python or torch broken)
fi

# --- the checks, most valuable first -----------------------------------------------------------
run_part probe 15 probe.json -- \
    sh -c "'$PY' -m offload probe --json --refresh --device '$DEVICE' >'$OUT/probe.json'"
run_part step 110 step/ -- "$PY" -m offload.bench "${STEP_ARGS[@]}" --out "$OUT/step"
run_part predict 20 predict.json -- "$PY" bench/predict.py --part step --step-dir "$OUT/step" --out "$OUT"
# Only the files with CUDA tests: collecting all of tests/ imports transformers, lightning and dynamo.
mapfile -t CUDA_TEST_FILES < <(grep -l 'mark\.cuda' tests/test_*.py)
run_part tests 60 tests.xml -- \
    "$PY" -m pytest -q -m cuda "${CUDA_TEST_FILES[@]}" -p no:cacheprovider --junitxml "$OUT/tests.xml"
run_part overhead 20 overhead.json -- "$PY" bench/overhead.py "${OVERHEAD_ARGS[@]}" --json-out "$OUT/overhead.json"
run_part layers 20 layers.json -- "$PY" bench/layers.py "${LAYER_ARGS[@]}" --json-out "$OUT/layers.json"

echo "summary: $OUT/summary.md ($((SECONDS - START_S))s in all)"
exit "$FAILED"
