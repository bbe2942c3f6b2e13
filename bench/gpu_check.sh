#!/usr/bin/env bash
# Device checks in one command, for a machine with one CUDA GPU (sized for an H200, < 5 minutes):
#
#   bash bench/gpu_check.sh OUTDIR          # from the repo root; no install, no internet needed
#
# Parts, each under `timeout` so one hang cannot eat the budget; a failure is recorded and the
# next part runs anyway:
#   env        nvidia-smi (name, memory, driver), python / torch / CUDA versions   -> env.json, gpu.csv
#   tests      python -m pytest -q -m cuda tests                                   -> tests.log, tests.xml
#   probe      python -m offload probe --json --refresh                            -> probe.json
#   layers     pytest bench (pytest-benchmark), else python bench/layers.py        -> layers.json
#   overhead   python bench/overhead.py --device cuda                              -> overhead.json
#   step       python bench/step.py --preset h200 --out OUTDIR/step (if it exists) -> step/
# then OUTDIR/summary.md (hardware, versions, date, each part's status and key figures) and
# OUTDIR/status.tsv. Exit status: 0 when no part failed, 1 otherwise.
#
# Knobs (environment): PYTHON (default python), GPU_CHECK_DEVICE (default cuda),
# GPU_CHECK_BUDGET_S (whole run, default 280), GPU_CHECK_QUICK=1 (tiny sizes and few rounds:
# checks the plumbing in seconds, e.g. on a CPU with GPU_CHECK_DEVICE=cpu).
set -u

OUT=${1:?usage: bash bench/gpu_check.sh OUTDIR}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)  # absolute, relative to where we were called from
cd "$(dirname "$0")/.." || exit 2

PY=${PYTHON:-python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET_S=${GPU_CHECK_BUDGET_S:-280}
QUICK=${GPU_CHECK_QUICK:-0}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# Per-part limits in seconds; a part gets less when the whole budget runs short.
T_ENV=20 T_TESTS=60 T_PROBE=20 T_LAYERS=60 T_OVERHEAD=35 T_STEP=120
KILL_AFTER_S=5      # SIGKILL this long after the SIGTERM of a timeout
MIN_PART_S=10       # below this much time left, a part is skipped rather than started
SUMMARY_RESERVE_S=8 # kept back for writing the summary

OVERHEAD_ARGS=(--device "$DEVICE")
LAYER_ARGS=(--device "$DEVICE")
if [ "$QUICK" = 1 ]; then
    export OFFLOAD_BENCH_SIZES=tiny
    OVERHEAD_ARGS+=(--steps 3 --repeats 3 --warmup 1 --chain 200)
fi

START_S=$SECONDS
STATUS="$OUT/status.tsv"
printf 'part\tstatus\trc\tseconds\tlimit_s\toutput\n' >"$STATUS"
FAILED=0

# run_part NAME LIMIT_S OUTPUT -- command...   (stdout+stderr go to OUTDIR/NAME.log)
# Exit status 5 is pytest's "no tests collected": recorded as such, not as a failure.
run_part() {
    local name=$1 limit=$2 output=$3
    shift 4
    local left=$((BUDGET_S - SUMMARY_RESERVE_S - (SECONDS - START_S)))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt "$MIN_PART_S" ]; then
        printf '%s\tskipped\t-\t0\t%s\t%s\n' "$name" "$limit" "no time left in the ${BUDGET_S}s budget" >>"$STATUS"
        echo "[$name] skipped: no time left"
        return 0
    fi
    echo "[$name] running (limit ${limit}s): $*"
    local t0=$SECONDS rc status
    timeout -k "$KILL_AFTER_S" "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout; FAILED=1 ;;
        5) status=no-tests ;;
        *) status=failed; FAILED=1 ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" "$output" >>"$STATUS"
    echo "[$name] $status (rc $rc, $((SECONDS - t0))s)"
    tail -n 3 "$OUT/$name.log" | sed "s/^/[$name]   /"
}

skip_part() {
    printf '%s\tskipped\t-\t0\t-\t%s\n' "$1" "$2" >>"$STATUS"
    echo "[$1] skipped: $2"
}

# --- env -------------------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    run_part gpu "$T_ENV" gpu.csv -- \
        sh -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee '$OUT/gpu.csv'"
else
    echo "n/a (no nvidia-smi)" >"$OUT/gpu.csv"
    skip_part gpu "nvidia-smi not found"
fi
run_part env "$T_ENV" env.json -- "$PY" -c '
import importlib.util, json, sys
sys.path.insert(0, "bench")
import torch, common
device = torch.device(sys.argv[1])
env = common.environment(device) if device.type != "cuda" or torch.cuda.is_available() else common.environment(torch.device("cpu"))
env["cuda_available"] = torch.cuda.is_available()
env["cuda_build"] = torch.version.cuda
env["pytest_benchmark"] = importlib.util.find_spec("pytest_benchmark") is not None
json.dump(env, open(sys.argv[2], "w"), indent=1)
print(json.dumps(env))
' "$DEVICE" "$OUT/env.json"

# --- the checks ------------------------------------------------------------------------------
run_part tests "$T_TESTS" tests.xml -- \
    "$PY" -m pytest -q -m cuda tests -p no:cacheprovider --continue-on-collection-errors --junitxml "$OUT/tests.xml"

run_part probe "$T_PROBE" probe.json -- \
    sh -c "'$PY' -m offload probe --json --refresh --device '$DEVICE' >'$OUT/probe.json'"

if "$PY" -c "import pytest_benchmark" >/dev/null 2>&1; then
    run_part layers "$T_LAYERS" layers.json -- \
        env OFFLOAD_BENCH_DEVICE="$DEVICE" OFFLOAD_BENCH_OUT="$OUT/layers.json" \
        "$PY" -m pytest bench -q -p no:cacheprovider --benchmark-columns=min,median,iqr,rounds \
        --benchmark-json "$OUT/layers-pytest-benchmark.json"
else
    echo "[layers] pytest-benchmark is not importable: running the plain-python runner instead"
    run_part layers "$T_LAYERS" layers.json -- \
        "$PY" bench/layers.py "${LAYER_ARGS[@]}" --json-out "$OUT/layers.json"
fi

run_part overhead "$T_OVERHEAD" overhead.json -- \
    "$PY" bench/overhead.py "${OVERHEAD_ARGS[@]}" --json-out "$OUT/overhead.json"

if [ -f bench/step.py ]; then
    run_part step "$T_STEP" step/ -- "$PY" bench/step.py --preset h200 --out "$OUT/step"
else
    skip_part step "bench/step.py does not exist yet"
fi

# --- summary ---------------------------------------------------------------------------------
# A plain one first, so that a broken python still leaves a summary; then the full one.
{
    echo "# offload device check"
    echo
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ), device: $DEVICE, gpu: $(cat "$OUT/gpu.csv" 2>/dev/null)"
    echo
    echo '```'
    column -t -s $'\t' "$STATUS" 2>/dev/null || cat "$STATUS"
    echo '```'
} >"$OUT/summary.md"
timeout -k 2 "$SUMMARY_RESERVE_S" "$PY" - "$OUT" "$DEVICE" "$((SECONDS - START_S))" <<'PYEOF' || echo "summary: the python summary failed; summary.md has the plain one"
import csv, json, sys
from pathlib import Path

out, device, total_s = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None

env = load("env.json") or {}
lines = ["# offload device check", ""]
lines.append(f"- date (UTC): {env.get('date_utc', '?')}; total {total_s} s")
lines.append(f"- GPU (nvidia-smi name, memory, driver): {(out / 'gpu.csv').read_text().strip() if (out / 'gpu.csv').exists() else 'n/a'}")
lines.append(f"- host: {env.get('host_cpu', '?')}, {env.get('cpu_cores_logical', '?')} cores, {env.get('ram_gb', '?')} GB RAM")
lines.append(f"- versions: python {env.get('python', '?')}, torch {env.get('torch', '?')} (CUDA {env.get('cuda_build')}), "
             f"offload {env.get('offload', '?')} at {env.get('git_commit', '?')}; pytest-benchmark: {env.get('pytest_benchmark')}")
lines += ["", "## Parts", "", "| part | status | rc | seconds | limit s | output |", "|---|---|---|---|---|---|"]
with open(out / "status.tsv") as f:
    for row in csv.DictReader(f, delimiter="\t"):
        lines.append(f"| {row['part']} | {row['status']} | {row['rc']} | {row['seconds']} | {row['limit_s']} | {row['output']} |")

probe = load("probe.json")
if probe:
    lines += ["", "## Probe", ""]
    lines += [f"- {k}: {v}" for k, v in probe.items()]

layers = load("layers.json")
if layers:
    lines += ["", f"## Layers ({layers.get('runner')}, sizes {layers.get('size_preset')})", "",
              "transfer = step under engine(budget 0) minus plain step (unhidden round trip); recompute = one forward.", "",
              "| layer | size | shape | dtype | saved MB | keep ms | transfer ms | recompute ms | GB/s | winner |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in layers.get("rows", []):
        shape = "x".join(map(str, r["shape"]))
        lines.append(f"| {r['layer']} | {r['size']} | {shape} | {r['dtype']} | {r.get('saved_bytes', 0) / 2**20:.1f} | "
                     f"{r['keep_ms']:.2f} | {r['transfer_ms']:.2f} | {r['recompute_ms']:.2f} | "
                     f"{r.get('round_trip_gb_per_s') or '-'} | {r['winner']} |")
    fit = layers.get("transfer_fit")
    if fit:
        lines += ["", f"Fit: transfer ms = {fit['ms_per_mb']} x saved MB + {fit['ms_per_tensor']} x saved tensors "
                      f"(round trip {fit['round_trip_gb_per_s']} GB/s; median error {fit['median_abs_error_ms']} ms)."]

over = load("overhead.json")
if over:
    pt, st = over["per_tensor"], over["step"]
    lines += ["", "## Overhead", "", "Per saved tensor, pack + unpack, median us: " +
              ", ".join(f"{name} {v['median_us']}" for name, v in pt["variants"].items()), ""]
    lines.append(f"MiniGPT {st['model']}, {st['saved_tensors_per_step']} saved tensors / step:")
    lines += ["", "| variant | median step ms | overhead | paired overhead | min step ms | moved MB/step |",
              "|---|---|---|---|---|---|"]
    for name, v in st["variants"].items():
        lines.append(f"| {name} | {v['median_ms']} | {100 * v['overhead']:+.2f}% | {100 * v['paired_overhead']:+.2f}% | "
                     f"{v['min_ms']} | {v.get('offloaded_mb_per_step', '-')} |")
    lines.append("")
    lines.append(f"Budget None overhead {100 * st['overhead_budget_none']:+.2f}% (target <= {100 * st['target_overhead']:.0f}%)")

step_dir = out / "step"
if step_dir.is_dir():
    lines += ["", "## Step benchmark (bench/step.py --preset h200)", ""]
    for p in sorted(step_dir.glob("*.json")):
        lines.append(f"- {p.name}: `{p.read_text().strip()[:600]}`")
    for p in sorted(step_dir.glob("*.md")):
        lines += ["", p.read_text().strip()]

lines += ["", "Logs: one `<part>.log` per part in this directory."]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print(f"wrote {out / 'summary.md'}")
PYEOF

echo "summary: $OUT/summary.md ($((SECONDS - START_S))s in all)"
exit "$FAILED"
