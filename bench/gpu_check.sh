#!/usr/bin/env bash
# Device checks in one command, for a machine with one CUDA GPU (sized for an H200: at most 330 s
# of parts, each designed to end within 60 % of its limit, so the whole fits a 6-minute call and
# usually ends in about 3):
#
#   bash bench/gpu_check.sh OUTDIR          # from anywhere; no install, no internet needed
#
# Parts, in order of value, each under its own `timeout` (limit in seconds); a part that fails or
# times out is recorded and the next one runs:
#   env        30  nvidia-smi, python / torch / CUDA versions, CUDA available?    -> env.json, gpu.csv
#   probe      30  python -m offload probe --json --refresh                       -> probe.json
#   step      115  python -m offload.bench --preset h200 (the 7B-class comparison; each configuration's
#                  loss and gradients checked bitwise at the timed shape first)    -> step/
#   predict    15  python bench/predict.py --part step: offload.predict of the step part's model and
#                  configurations (a named machine, the probe's link), beside what step measured -> predict.json
#   tests      60  python -m pytest -m cuda <the test files with cuda tests, test_cuda*.py first> -> tests.xml
#   sanitizer  35  tests/test_cuda.py's stream-protocol tests again under PyTorch's CUDA sanitizer
#                  (TORCH_CUDA_SANITIZER=1; the engine waits at every use there) -> sanitizer.xml
#   overhead   25  python bench/overhead.py --device cuda                          -> overhead.json
#   layers     20  python bench/layers.py --device cuda (the transfer/recompute fit) -> layers.json
# Each part is designed to end within FIT_PERCENT (60 %) of its limit whatever the GPU's speed: step,
# overhead and layers get a time limit of their own, that share of the part's less the start-up it
# does not count (--time-limit-s: a configuration, an interleaved round or a layer case that would end
# past it is skipped, the part still reports, and the rest of the limit covers giving pinned memory
# back and the last writes); the pytest parts start no test past DEADLINE_PERCENT (85 %) of theirs
# (OFFLOAD_TEST_DEADLINE, tests/conftest.py: the rest are skipped, saying why) and print every test's
# time (--durations=0), so one window sizes the next; step and layers share pinned slabs among their
# engines instead of pinning afresh; the pytest parts collect only the files with CUDA tests; the probe
# is measured once (its cache under OUTDIR/cache, keyed by one intra-op thread in every part, the
# tests' setting). A timeout sends SIGINT first (-s INT), so pytest writes its XML and the scripts
# write what they measured; SIGKILL follows KILL_AFTER_S later. tests/test_gpu_check.py checks the
# shares against the limits, and the CPU dry run's part times against them.
# Each part leaves NAME.log and NAME.part.json (status, rc, seconds, limit) the moment it ends,
# and after each part summary.json and summary.md are rewritten whole (bench/gpu_summary.py: first
# which parts passed and, for each that did not, why; then every part's key figures, hardware,
# versions, date; written to a temporary file and renamed, so a reader never sees one cut short).
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
# The parts' limits, and the share of each a part is designed to end within.
FIT_PERCENT=60
# env and probe pay the first cold `import torch` and CUDA context of a fresh machine (seconds each).
ENV_LIMIT_S=30 PROBE_LIMIT_S=30 STEP_LIMIT_S=115 PREDICT_LIMIT_S=15 TESTS_LIMIT_S=60 SANITIZER_LIMIT_S=35
OVERHEAD_LIMIT_S=25 LAYERS_LIMIT_S=20
# GPU_CHECK_LIMIT_SCALE (a whole number, default 1) multiplies every limit above. The suite's CPU dry
# run sets it large: a unit test must not depend on how busy its machine is, so there the limits only
# catch a hang; whether each part fits its share of the real limits is for the GPU window's own
# summary (each part's seconds against its limit), not for a test.
LIMIT_SCALE=${GPU_CHECK_LIMIT_SCALE:-1}
for part in ENV PROBE STEP PREDICT TESTS SANITIZER OVERHEAD LAYERS; do
    eval "${part}_LIMIT_S=\$((${part}_LIMIT_S * LIMIT_SCALE))"
done
# fit LIMIT STARTUP: the part's own time limit, FIT_PERCENT of LIMIT less the STARTUP seconds the
# part spends before its clock starts (imports, CUDA initialization, the probe's cache read).
fit() { echo $(($1 * FIT_PERCENT / 100 - $2)); }
STEP_TIME_LIMIT_S=$(fit "$STEP_LIMIT_S" 12)
# bench/overhead.py counts its time limit from its own start (imports and CUDA's set-up included).
OVERHEAD_TIME_LIMIT_S=$(fit "$OVERHEAD_LIMIT_S" 0)
LAYERS_TIME_LIMIT_S=$(fit "$LAYERS_LIMIT_S" 6)
# A pytest part starts no test past DEADLINE_PERCENT of its limit: its tests take seconds each, and
# a cold GPU machine spends an estimated 27-33 s of the tests part's 60 (15-20 s of the sanitizer's
# 35) on pytest's start, CUDA's context and the first kernels, so FIT_PERCENT's 60 % would skip tests
# that fit. A test not started by then is skipped, saying why, and the part reads "incomplete".
DEADLINE_PERCENT=85
TESTS_DEADLINE_S=$((TESTS_LIMIT_S * DEADLINE_PERCENT / 100))
SANITIZER_DEADLINE_S=$((SANITIZER_LIMIT_S * DEADLINE_PERCENT / 100))
# Under the sanitizer: the tests of the stream protocol, not those that remove a guard on purpose.
SANITIZER_SELECT="not guard_removed"

STEP_ARGS=(--preset h200 --time-limit-s "$STEP_TIME_LIMIT_S")
# The CPU cannot train the h200 shapes in a part's time: it runs the CPU demo preset, as much as fits.
[ "$DEVICE" = cpu ] && STEP_ARGS=(--preset demo --time-limit-s "$STEP_TIME_LIMIT_S")
OVERHEAD_ARGS=(--device "$DEVICE" --steps 10 --repeats 5 --warmup 1 --time-limit-s "$OVERHEAD_TIME_LIMIT_S")
LAYER_ARGS=(--device "$DEVICE" --time-limit-s "$LAYERS_TIME_LIMIT_S")
# Nor the layers part its CPU sizes (about a minute on 2 cores): tiny ones, all of which fit.
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
run_part env "$ENV_LIMIT_S" env.json -- "$PY" -c '
import json, sys, torch
from offload.bench.measure import environment, write_json
cuda = torch.cuda.is_available()
env = environment(torch.device("cuda" if cuda and sys.argv[1] == "cuda" else "cpu")) | {"cuda": cuda}
write_json(sys.argv[2], env)
print(json.dumps(env))
' "$DEVICE" "$OUT/env.json"
if grep -q '"cuda": true' "$OUT/env.json" 2>/dev/null; then CUDA_OK=1; fi

if [ "$DEVICE" = cuda ] && [ -z "${CUDA_OK:-}" ]; then
    for part in probe step predict tests sanitizer overhead layers; do
        skip_part "$part" "no CUDA device here (torch.cuda.is_available() is False)"
    done
    echo "summary: $OUT/summary.md (no CUDA: GPU parts skipped, $((SECONDS - START_S))s)"
    exit "$FAILED"  # 0 unless the env part itself failed (python or torch broken)
fi

# --- the checks, most valuable first -----------------------------------------------------------
run_part probe "$PROBE_LIMIT_S" probe.json -- \
    sh -c "'$PY' -m offload probe --json --refresh --device '$DEVICE' >'$OUT/probe.json'"
run_part step "$STEP_LIMIT_S" step/ -- "$PY" -m offload.bench "${STEP_ARGS[@]}" --out "$OUT/step"
run_part predict "$PREDICT_LIMIT_S" predict.json -- \
    "$PY" bench/predict.py --part step --step-dir "$OUT/step" --out "$OUT"
# Only the files with CUDA tests: collecting all of tests/ imports transformers, lightning and dynamo.
mapfile -t CUDA_TEST_FILES < <(grep -l 'mark\.cuda' tests/test_*.py)
# The engine's own CUDA tests first: a part's deadline leaves out the last files, not these. Under
# the sanitizer (every op walks the Python stack: several times slower) only the stream protocol's.
ENGINE_TEST_FILES=() OTHER_TEST_FILES=() SANITIZER_TEST_FILES=()
for file in "${CUDA_TEST_FILES[@]}"; do
    case $file in
        tests/test_cuda*.py) ENGINE_TEST_FILES+=("$file") ;;
        *) OTHER_TEST_FILES+=("$file") ;;
    esac
    if [ "$file" = tests/test_cuda.py ]; then SANITIZER_TEST_FILES+=("$file"); fi
done
CUDA_TEST_FILES=("${ENGINE_TEST_FILES[@]}" "${OTHER_TEST_FILES[@]}")
# An empty list would have pytest collect all of tests/ (its testpaths): name the file that is
# missing instead, so the part fails at once and its log says which ("file or directory not found").
run_part tests "$TESTS_LIMIT_S" tests.xml -- env OFFLOAD_TEST_DEADLINE=$(($(date +%s) + TESTS_DEADLINE_S)) \
    "$PY" -m pytest -q -m cuda "${CUDA_TEST_FILES[@]:-tests/test_cuda.py}" -p no:cacheprovider --durations=0 \
    --junitxml "$OUT/tests.xml"
# The sanitizer sees stream waits, not Event.query(): under it the engine waits at every use
# (OFFLOAD_ALWAYS_WAIT, on by itself under TORCH_CUDA_SANITIZER; see offload/_memory/transfer.py).
run_part sanitizer "$SANITIZER_LIMIT_S" sanitizer.xml -- env TORCH_CUDA_SANITIZER=1 OFFLOAD_ALWAYS_WAIT=1 \
    OFFLOAD_TEST_DEADLINE=$(($(date +%s) + SANITIZER_DEADLINE_S)) \
    "$PY" -m pytest -q -m cuda "${SANITIZER_TEST_FILES[@]:-tests/test_cuda.py}" -k "$SANITIZER_SELECT" -p no:cacheprovider \
    --durations=0 --junitxml "$OUT/sanitizer.xml"
run_part overhead "$OVERHEAD_LIMIT_S" overhead.json -- \
    "$PY" bench/overhead.py "${OVERHEAD_ARGS[@]}" --json-out "$OUT/overhead.json"
run_part layers "$LAYERS_LIMIT_S" layers.json -- \
    "$PY" bench/layers.py "${LAYER_ARGS[@]}" --json-out "$OUT/layers.json"

echo "summary: $OUT/summary.md ($((SECONDS - START_S))s in all)"
# A pytest part that exited 0 with tests left unrun past its deadline reads "incomplete" there.
if grep -q '"status": "incomplete"' "$OUT/summary.json" 2>/dev/null; then FAILED=1; fi
exit "$FAILED"
