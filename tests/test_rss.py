"""On the CPU, spilled activations really leave the process's memory.

Oracle: the peak resident set size of a fresh process running one training step, without the
engine and with ``budget_mb=0`` spilling to a directory on a real disk. The difference must be at
least half of the activation bytes the engine reports managing (``stats.saved_bytes``); the rest
of the gap is slack for what both runs hold anyway (the tensor in use, its gradient, the
allocator's own caching).

Each run is its own process because the peak (``VmHWM``) is a high-water mark that never comes
down; ``ru_maxrss`` is not used because Linux carries it over from the parent across exec.
No malloc tuning (``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_``) is set: the test holds
with glibc's defaults, as a user would run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from offload.seams import Host

REPO_ROOT = Path(__file__).resolve().parents[1]

WIDTH = 128
BATCH = 65536
DEPTH = 12
"""12 layers of 65536 x 128 fp32 activations: 32 MiB saved per layer, ~416 MiB in all with the
input, and weights of 64 KiB each, so activations dominate and each matmul is cheap on two cores."""

MIN_FREED_FRACTION = 0.5
"""Share of the engine's saved bytes that must leave the resident set at budget 0."""

STEP = r"""
import json, resource, sys
import torch
torch.set_num_threads(2)
use_engine, spill_dir, width, batch, depth = sys.argv[1] == "1", sys.argv[2], *map(int, sys.argv[3:6])
torch.manual_seed(0)
layers = []
for _ in range(depth):
    layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
x = torch.randn(batch, width)
saved = 0
if use_engine:
    import offload
    eng = offload.engine(0, spill_dir=spill_dir, model=model)
    with eng:
        loss = model(x).sum()
    loss.backward()
    saved = eng.stats.saved_bytes
    spilled = eng.stats.spilled_bytes
    eng.close()
else:
    loss = model(x).sum()
    loss.backward()
    spilled = 0
def peak_rss_bytes():
    # VmHWM: the high-water mark of this process's own memory map. ru_maxrss would not do: Linux
    # carries it across fork + exec, so a child of a big parent (pytest late in a suite) starts
    # with the parent's resident set as its "peak".
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_rss_bytes": peak_rss_bytes(),
                  "saved_bytes": saved, "spilled_bytes": spilled,
                  "grad": model[0].weight.grad.double().sum().item()}))
"""


def _run(use_engine: bool, spill_dir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX"):
        env.pop(name, None)  # glibc defaults, as a user runs
    args = [sys.executable, "-c", STEP, "1" if use_engine else "0", str(spill_dir), str(WIDTH), str(BATCH), str(DEPTH)]
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # fresh processes, each a whole run
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is in KiB on Linux only")
def test_spilled_activations_leave_the_resident_set(spill_dir):
    if Host().filesystem_type(Path(spill_dir)) in ("tmpfs", "ramfs"):
        pytest.skip(f"{spill_dir} is on a RAM filesystem: spilling there frees no memory")
    free = psutil.disk_usage(str(spill_dir)).free
    if free < 2 * DEPTH * BATCH * WIDTH * 4:
        pytest.skip(f"not enough disk under {spill_dir} for the spill files")
    without = _run(False, spill_dir)
    with_engine = _run(True, spill_dir)
    activation_bytes = with_engine["saved_bytes"]
    assert activation_bytes >= DEPTH * BATCH * WIDTH * 4, with_engine
    assert with_engine["spilled_bytes"] == activation_bytes
    assert with_engine["grad"] == without["grad"], "same step, same gradient"
    freed = without["peak_rss_bytes"] - with_engine["peak_rss_bytes"]
    assert freed >= MIN_FREED_FRACTION * activation_bytes, (
        f"peak RSS without the engine {without['peak_rss_bytes'] / 2**20:.0f} MiB, with budget 0 "
        f"{with_engine['peak_rss_bytes'] / 2**20:.0f} MiB: {freed / 2**20:.0f} MiB freed of "
        f"{activation_bytes / 2**20:.0f} MiB of activations"
    )
    assert list(spill_dir.rglob("*")) == [], "close() removed the spill directory"
