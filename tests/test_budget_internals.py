"""The budget that follows free memory, from inside: the default reading of free memory (cgroups
on the CPU, the allocator and driver on CUDA), the band within which a plan stands, and the store
meeting a budget that falls while backward unpacks.

White-box, on purpose. ``test_auto_budget.py`` drives ``budget_mb="auto"`` through the public seam
``engine(memory=FreeMemory(...))``, which replaces the default reading rather than showing it; the
reading's cgroup files and the re-plan band are pure functions of ``offload._budget``, tested here
with numbers; and where backward's order of unpacks meets a budget that fell between two of them
(a kept tensor not moved yet, a copy still on its way) is a point no public seam can pause at, so
the store is driven directly and its invariants checked after every unpack.
"""

from __future__ import annotations

import math

import pytest
import torch

from offload._budget import (
    REPLAN_ABOVE,
    REPLAN_BELOW,
    REPLAN_MIN_GAIN_BYTES,
    FreeMemory,
    _cgroup_left,
    device_free_bytes,
    memory_cgroups,
    replan_needed,
)
from offload._config import Config
from offload._memory.entry import Residence, Tier
from offload._memory.pending import FromFuture
from offload._memory.store import Store
from offload._stats import Counters
from zoo import MB


def test_replan_band():
    planned = 100 * MB
    assert not replan_needed(planned, planned)
    assert not replan_needed(planned, int(planned * REPLAN_BELOW))
    assert replan_needed(planned, int(planned * REPLAN_BELOW) - 1)
    assert not replan_needed(planned, int(planned * REPLAN_ABOVE))
    assert replan_needed(planned, int(planned * REPLAN_ABOVE) + 1)
    assert not replan_needed(0, REPLAN_MIN_GAIN_BYTES - 1), "a tiny rise from 0 does not re-plan"
    assert replan_needed(0, REPLAN_MIN_GAIN_BYTES)
    assert not replan_needed(None, None) and replan_needed(None, 1)


def _fake_cgroups(tmp_path, version: int, limit: str, usage: int, inactive: int):
    """A /proc/self/cgroup and a cgroup tree as the kernel lays them out (v1 or v2)."""
    root = tmp_path / "cgroup"
    if version == 2:
        group = root / "kubepods" / "pod1"
        names = ("memory.max", "memory.current", "inactive_file")
        proc = "0::/kubepods/pod1\n"
    else:
        group = root / "memory" / "docker" / "c1"
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        proc = "5:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n"
    group.mkdir(parents=True)
    (group / names[0]).write_text(limit + "\n")
    (group / names[1]).write_text(f"{usage}\n")
    (group / "memory.stat").write_text(f"anon 1\n{names[2]} {inactive}\nactive_file 5\n")
    proc_file = tmp_path / "proc_cgroup"
    proc_file.write_text(proc)
    return memory_cgroups(proc_file, root), group


@pytest.mark.parametrize("version", [1, 2])
def test_cpu_reading_respects_the_containers_memory_limit(tmp_path, version):
    """A container's limit, not the host's free RAM: limit - (usage - inactive file cache)."""
    limit, usage, inactive = 3 * MB * 1024, 2 * MB * 1024, 256 * MB
    groups, group = _fake_cgroups(tmp_path, version, str(limit), usage, inactive)
    assert group in groups
    cpu = torch.device("cpu")
    host = device_free_bytes(cpu)
    assert host > limit - (usage - inactive), "this machine has too little RAM for the test to mean anything"
    assert device_free_bytes(cpu, groups) == limit - (usage - inactive)


@pytest.mark.parametrize("version, limit", [(1, "9223372036854771712"), (2, "max")])
def test_cpu_reading_without_a_container_limit_is_the_hosts(tmp_path, version, limit):
    """v2 writes "max"; v1 writes no limit as 2**63 - 1 rounded down to a page, a number: both read
    as no limit at all (not as a limit of 9.2 EB that only happens to exceed the host's RAM)."""
    groups, group = _fake_cgroups(tmp_path, version, limit, 10 * MB, 0)
    assert _cgroup_left(group) is None, "no limit"
    cpu = torch.device("cpu")
    assert abs(device_free_bytes(cpu, groups) - device_free_bytes(cpu)) < 256 * MB  # both psutil's, a moment apart


@pytest.mark.parametrize("version", [1, 2])
def test_cpu_reading_respects_a_limit_set_on_an_ancestor_cgroup(tmp_path, version):
    """A limit on the pod (or the docker parent), none on the process's own group: the reading
    walks up from the process's group and takes the tightest it finds."""
    limit, usage = 2 * MB * 1024, MB * 1024
    _, group = _fake_cgroups(tmp_path, version, "max" if version == 2 else "9223372036854771712", 10 * MB, 0)
    parent = group.parent  # found only once it holds a limit: read the groups again below
    names = ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    (parent / names[0]).write_text(f"{limit}\n")
    (parent / names[1]).write_text(f"{usage}\n")
    (parent / "memory.stat").write_text("anon 1\n")
    proc = tmp_path / "proc_cgroup"
    groups = memory_cgroups(proc, tmp_path / "cgroup")
    assert groups[0] == group and parent in groups, groups
    cpu = torch.device("cpu")
    assert device_free_bytes(cpu) > limit - usage, "this machine has too little RAM for the test to mean anything"
    assert device_free_bytes(cpu, groups) == limit - usage


# ------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reading_counts_the_allocators_unused_blocks():
    device = torch.device("cuda", torch.cuda.current_device())
    block = torch.empty(64 * MB, dtype=torch.uint8, device=device)
    del block  # back to the caching allocator, not to the driver
    free_driver, _ = torch.cuda.mem_get_info(device)
    cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert cached_unused >= 64 * MB
    assert device_free_bytes(device) >= free_driver + 64 * MB - MB  # the driver's figure may move a little


def test_tensors_not_moved_yet_go_when_the_budget_falls_in_backward(spill_dir, monkeypatch):
    """A plan that keeps a block before one it offloads: backward reaches the offloaded block's
    saves while the kept block's are still whole. When the budget has fallen below them meanwhile
    (the step allocated its gradients), just enough of them go, oldest first, and the unpack
    waits until they have left: the engine holds no more than the budget in force, and every
    tensor comes back exact. The offloaded block's copies out are still on their way as backward
    starts (a copy looks finished only once waited on): the newest is served from its original,
    a hit, not waited for and read back. Driven on the store itself, its invariants checked after
    every unpack. (With the shedding removed, 0.75 MB stays over a budget of 0.5 MB; with the
    tensor in use marked so only after the shedding, its copy lands under the wait, its original
    goes and it is read back, a miss: both shown once, by hand.)"""
    waited: set[int] = set()
    real_wait = FromFuture.wait
    monkeypatch.setattr(FromFuture, "done", lambda self: id(self.future) in waited and self.future.done())
    monkeypatch.setattr(FromFuture, "wait", lambda self: (waited.add(id(self.future)), real_wait(self))[1])
    device = {"capacity": 3 * MB, "other": 0}
    config = Config.from_user("auto", reserve_mb=1, device="cpu", min_offload_mb=0, spill_dir=spill_dir)
    stores: list[Store] = []

    def free() -> int:  # the device: what neither the store nor the rest of the step holds
        return max(0, device["capacity"] - device["other"] - sum(s.resident_bytes for s in stores))

    store = Store(config, torch.device("cpu"), Counters(), memory=FreeMemory(read=free, reread_bytes=0))
    stores.append(store)
    store.budget.set_planned(True)  # a plan is in force: nothing leaves before the budget says so
    kept = [torch.randn(256, 256) for _ in range(4)]  # the kept block's saves, 256 KiB each
    moved = [torch.randn(256, 256) for _ in range(2)]  # the offloaded block's, saved after them
    handles = [store.pack(t) for t in kept] + [store.pack(t, eager=True) for t in moved]
    assert store.gauges().peak_over_budget_bytes == 0
    assert [h.entry.residence for h in handles[4:]] == [Residence.LEAVING] * 2, "the premise: copies on their way"
    device["other"] = 3 * MB // 2  # backward allocates the gradients: the budget falls to 0.5 MB
    for i in reversed(range(len(handles))):  # backward's order: the offloaded block first
        assert torch.equal(store.unpack(handles[i]), (kept + moved)[i])
        store.residency.check()
        gauges = store.gauges()
        assert gauges.budget_bytes == MB // 2
        assert gauges.peak_over_budget_bytes == 0, f"unpack {i}: {gauges.peak_over_budget_bytes} bytes over"
        if i == 5:
            assert (store.counters.prefetch_hits, store.counters.prefetch_misses) == (1, 0), "served by its original"
            assert [h.entry.residence for h in handles[:4]] == [Residence.AWAY] * 2 + [Residence.HOT] * 2, (
                "just enough of the kept block left, the oldest"
            )
    store.close()


def test_a_budget_found_lower_by_a_reading_during_the_prefetch_is_held(spill_dir):
    """Free memory is read by a rule (every so many bytes saved or loaded), not on every unpack,
    so backward can allocate its gradients with no reading seeing it until a prefetch's load
    comes due. The prefetch must stop at the budget that reading finds, not count down the room
    it found at its start, and what that reading shows already over goes before the unpack
    returns: a kept tensor not moved yet, the oldest. Every unpack exact, the store's invariants
    checked, never over the budget in force, each moved tensor read back once. (With the prefetch
    counting down its first room, it reads every moved tensor back at once, and the fit after it
    has to move both kept tensors out; with that fit removed, one kept tensor stays 0.25 MB over:
    both shown once, by hand.)"""
    q = 256 * 1024
    device = {"capacity": 7 * MB, "other": 0}
    config = Config.from_user("auto", reserve_mb=3, device="cpu", min_offload_mb=0, spill_dir=spill_dir)
    stores: list[Store] = []

    def free() -> int:
        return max(0, device["capacity"] - device["other"] - sum(s.resident_bytes for s in stores))

    # read after every two tensors' bytes, never by time: the test says when a reading comes due
    memory = FreeMemory(read=free, reread_bytes=2 * q, reread_ms=math.inf)
    store = Store(config, torch.device("cpu"), Counters(), memory=memory)
    stores.append(store)
    store.budget.set_planned(True)
    kept = [torch.randn(256, 256) for _ in range(2)]  # 256 KiB each, saved first, not moved
    moved = [torch.randn(256, 256) for _ in range(6)]  # then a block moved at once
    handles = [store.pack(t) for t in kept] + [store.pack(t, eager=True) for t in moved]
    for h in handles[2:]:  # the moved block's copies land before backward
        h.entry.copies[Tier.DISK].filled.wait()
    store.read_free()  # a step's reading: the device is free, the budget is 4 MB
    assert store.gauges().budget_bytes == 4 * MB
    device["other"] = 15 * q  # backward allocates its gradients (the budget is now 0.25 MB); no reading is due
    for i in reversed(range(len(handles))):
        assert torch.equal(store.unpack(handles[i]), (kept + moved)[i])
        store.residency.check()
        gauges = store.gauges()
        assert gauges.peak_over_budget_bytes == 0, (
            f"unpack {i}: {gauges.peak_over_budget_bytes} bytes over {gauges.budget_bytes}"
        )
        if i == 7:
            assert gauges.budget_bytes == q, "the premise: the prefetch's reading found the budget fallen"
            assert [h.entry.residence for h in handles[:2]] == [Residence.AWAY, Residence.HOT], (
                "just enough of the kept tensors left, the oldest"
            )
    assert store.counters.reloaded_bytes == 7 * q, "each moved tensor (and the kept one that left) read back once"
    store.close()
