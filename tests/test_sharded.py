"""Saves shared by a process group, stored once across it (``offload.sharded``, ``shared_inputs=``).

2 and 4 CPU ranks on gloo, launched with torchrun, run ``tests/shard_worker.py``: a Megatron-style
tensor-parallel stack (replicated norm, column-parallel then row-parallel linear, all-reduce),
three steps of changing sequence length per configuration, budgets None / 0 / a third of what the
blocks save, the saves declared by the block (``offload.sharded(verify=True)``) or the inputs of
blocks run as recompute (``shared_inputs=``), each against the same engine with nothing shared.
Oracle: each rank's gradients against its own run without the engine, ``torch.equal`` (the engine
moves bytes; the collectives sum the same values in the same order).

The rest runs in this process: what happens without a group, with a group of one, and with
arguments that cannot work. One test is white-box: the all-gather's fallback for backends without
``all_gather_into_tensor`` (``offload._memory.sharded._all_gather_into``) over a stand-in
``torch.distributed``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import offload
import offload._memory.sharded

WORKER = Path(__file__).with_name("shard_worker.py")
LAUNCH_TIMEOUT_S = 300
"""Four ranks on 2 idle cores finish in about 40 s; room for a busy host."""
BUDGETS = ("none", "0", "small")
MODES = ("declared", "recompute")

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this build",
)


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request, tmp_path_factory) -> list[dict]:
    world = request.param
    out = tmp_path_factory.mktemp(f"sharded{world}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(WORKER),
        str(out),
        "--layers=2",
        "--steps=3",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(WORKER.parents[1]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    files = [out / f"rank{r}.json" for r in range(world)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, (
        f"ranks wrote no results {missing} (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
    )
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.slow  # launches 2 and 4 processes (the `ranks` fixture)
@needs_gloo
def test_gradients_bitwise_equal_with_saves_shared(ranks):
    for res in ranks:
        for name, config in res["configs"].items():
            assert config["exact"], f"rank {res['rank']} of {res['world']}, {name}: gradients differ from no engine"
    assert len(ranks[0]["configs"]) == len(BUDGETS) * len(MODES) * 2


@pytest.mark.slow  # launches 2 and 4 processes (the `ranks` fixture)
@needs_gloo
def test_each_rank_keeps_its_slice_of_the_shared_saves(ranks):
    for res in ranks:
        world = res["world"]
        for budget in BUDGETS:
            for mode in MODES:
                whole = res["configs"][f"{budget}/{mode}/whole"]["stats"]
                shared = res["configs"][f"{budget}/{mode}/shared"]["stats"]
                where = f"rank {res['rank']} of {world}, {budget}/{mode}"
                assert whole["shared_bytes"] == 0
                assert shared["shared_bytes"] > 0.1 * whole["saved_bytes"], f"{where}: the premise, saves declared"
                assert shared["shared_kept_bytes"] * world >= shared["shared_bytes"]
                assert shared["shared_kept_bytes"] <= 1.01 * shared["shared_bytes"] / world, f"{where}: not 1/N"
                # what is kept of the shared saves is all this rank saves of them
                assert (
                    shared["saved_bytes"] == whole["saved_bytes"] - shared["shared_bytes"] + shared["shared_kept_bytes"]
                )
                # each storage gathered once per backward, every rank's slice
                assert shared["gathered_bytes"] == shared["shared_kept_bytes"] * world, where


@pytest.mark.slow  # launches 2 and 4 processes (the `ranks` fixture)
@needs_gloo
def test_at_budget_zero_a_rank_moves_its_slice_only(ranks):
    for res in ranks:
        for mode in MODES:
            whole = res["configs"][f"0/{mode}/whole"]["stats"]
            shared = res["configs"][f"0/{mode}/shared"]["stats"]
            assert whole["offloaded_bytes"] == whole["saved_bytes"]
            moved_less = whole["offloaded_bytes"] - shared["offloaded_bytes"]
            assert moved_less == shared["shared_bytes"] - shared["shared_kept_bytes"], f"rank {res['rank']}, {mode}"


@pytest.mark.slow  # launches 2 and 4 processes (the `ranks` fixture)
@needs_gloo
def test_verify_names_a_save_the_ranks_do_not_share(ranks):
    for res in ranks:
        message = res["mismatch"]
        assert "(64,) torch.float32" in message and "declared shared" in message, message
        assert str(list(range(1, res["world"]))) in message, message


@pytest.mark.slow  # launches 2 and 4 processes (the `ranks` fixture)
@needs_gloo
def test_the_edges_of_a_shared_save(ranks):
    for res in ranks:
        assert res["tiny"] == {"shared_bytes": 0, "saved_bytes": 1, "grad": 2.0}, "a 1-byte save is kept whole"
        views = res["views"]
        assert views["exact"]
        assert views["shared_bytes"] == views["storage_bytes"], "two views of one storage: one shard"
        assert views["gathered_bytes"] == views["storage_bytes"], "two views of one storage: gathered once"
        assert "modified by an inplace operation" in res["inplace"], res["inplace"]
        assert "policy='auto'" in res["under_auto"], "a declared save where ranks plan apart is refused on every rank"


@pytest.mark.slow  # launches 2 and 4 processes (the `ranks` fixture)
@needs_gloo
def test_sharded_around_recomputed_regions_declares_what_shared_inputs_did(ranks):
    """The one way that ``shared_inputs=``'s deprecation names: ``offload.sharded(group)`` around the
    regions' calls under ``policy="recompute"`` declares the same bytes, with the same gradients."""
    for res in ranks:
        one_way = res["one_way"]
        assert one_way["exact"], f"rank {res['rank']}: the two ways' gradients differ"
        assert one_way["sharded"] == one_way["shared_inputs"], one_way
        assert one_way["sharded"]["shared_bytes"] > 0, "the premise: the regions' inputs are declared"


# ---------------------------------------------------------------------------- in this process


def test_without_torch_distributed_initialized_the_error_names_the_fix():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(offload.OffloadError, match="init_process_group"):
        with offload.sharded():
            pass
    with pytest.raises(TypeError, match="verify must be True or False"):
        with offload.sharded(verify="yes"):
            pass


def test_shared_inputs_needs_regions_and_a_group():
    with pytest.raises(ValueError, match="regions="):
        offload.engine(None, shared_inputs=object())
    with pytest.raises(TypeError, match="group.WORLD"):
        offload.engine(None, regions=[torch.nn.Linear(2, 2)], policy="recompute", shared_inputs=True)
    with pytest.raises(ValueError, match="policy='recompute'"):  # a profiled policy plans each rank apart
        offload.engine(None, regions=[torch.nn.Linear(2, 2)], shared_inputs=object())


@needs_gloo
def test_a_group_of_one_splits_nothing():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(64, 64, requires_grad=True)
        want = torch.autograd.grad(torch.tanh(x * 2).sum(), x)[0]
        eng = offload.engine(0, min_offload_mb=0, device="cpu")
        with eng, offload.sharded(verify=True):
            loss = torch.tanh(x * 2).sum()
        got = torch.autograd.grad(loss, x)[0]
        stats = eng.stats
        eng.close()
        assert torch.equal(got, want)
        assert stats.shared_bytes == 0 and stats.saved_bytes > 0, "saved whole, as without the declaration"
    finally:
        dist.destroy_process_group()


class _Collectives:
    """Stands in for ``torch.distributed``'s all-gathers (no process group here): the backend the
    group reports, which form was called, and a flat form that fails as a real NCCL error would."""

    def __init__(self, monkeypatch, backend: str, flat_fails: bool = False) -> None:
        self.calls: list[str] = []

        def flat(output, piece, group=None, async_op=False):
            self.calls.append("flat")
            if flat_fails:
                raise RuntimeError("NCCL error: unhandled system error")

        def as_list(parts, piece, group=None, async_op=False):
            self.calls.append("list")

        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(dist, "all_gather_into_tensor", flat)
        monkeypatch.setattr(dist, "all_gather_single", flat, raising=False)
        monkeypatch.setattr(dist, "all_gather", as_list)


@pytest.mark.parametrize(
    "backend, form", [("nccl", "flat"), ("gloo", "flat"), ("cpu:gloo,cuda:nccl", "flat"), ("mpi", "list")]
)
def test_the_gather_form_is_chosen_by_backend(backend, form, monkeypatch):
    """One collective per gather, its form decided by the group's backend: a backend with the flat
    form (``_allgather_base``: NCCL, Gloo) gets it, any other the list form, never one after the other."""
    calls = _Collectives(monkeypatch, backend).calls
    offload._memory.sharded._all_gather_into(torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), None)
    assert calls == [form]


def test_a_failing_gather_raises_and_is_not_retried(monkeypatch):
    """An NCCL error in the flat gather is raised, not answered by a second collective in the list
    form: that one would meet no partner on the ranks where the first went through (a hang)."""
    calls = _Collectives(monkeypatch, "nccl", flat_fails=True).calls
    with pytest.raises(RuntimeError, match="NCCL error"):
        offload._memory.sharded._all_gather_into(
            torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), None
        )
    assert calls == ["flat"]
