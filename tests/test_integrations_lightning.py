"""``offload.integrations.lightning.OffloadCallback`` under the real ``lightning.Trainer``.

A small MLP ``LightningModule`` is fit a few steps on the CPU, with and without the callback, same
seed: every step's loss and the final weights are bitwise equal (the math is identical), the
budget-0 engine moved every byte it saved and brought it back, its spill directory is empty after
``fit``. Covered: gradient accumulation, ``torch.utils.checkpoint`` inside the module, manual
optimization, and validation during ``fit`` (nothing saved through the engine). Skipped without
lightning (``pip install -e '.[lightning]'``; ``make test`` installs it).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

lightning = pytest.importorskip("lightning")

from offload.integrations.lightning import OffloadCallback  # noqa: E402
from zoo import files_under  # noqa: E402

BATCH, WIDTH, DEPTH = 8, 64, 3
SAMPLES = 32
"""Four batches; four optimizer steps, or two with accumulation 2."""
LBFGS_ITERATIONS = 3
MIN_OFFLOAD_BYTES = 1024
"""Below the default 64 KiB so this model's activations (8 x 64 fp32 = 2 KiB) move."""
KEEP_ALL_MB = 1 << 20
"""A budget (1 TiB) no step here comes near: nothing moves, every save is counted."""


class MLP(lightning.LightningModule):
    """Linear + ReLU blocks, optionally each under torch.utils.checkpoint; records each step's loss."""

    def __init__(self, *, checkpointing: bool = False, manual: bool = False, lbfgs: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)
        self.checkpointing = checkpointing
        self.automatic_optimization = not manual
        self.lbfgs = lbfgs
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.detach().clone())
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        if self.lbfgs:  # its step() calls the closure (forward + backward) several times
            return torch.optim.LBFGS(self.parameters(), lr=1e-2, max_iter=LBFGS_ITERATIONS)
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def data(rows: int = SAMPLES) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, WIDTH, generator=generator)
    y = torch.randn(rows, 1, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def fit(module, callbacks=(), *, accumulation: int = 1, validate: bool = False) -> "lightning.Trainer":
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulation,
        limit_val_batches=2 if validate else 0,
        val_check_interval=2 if validate else None,
        num_sanity_val_steps=1 if validate else 0,
        callbacks=list(callbacks),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|log_every_n_steps|val_dataloader|LeafSpec).*")
        trainer.fit(module, data(), data(16) if validate else None)
    return trainer


VARIANTS = {
    "plain": dict(),
    "accumulate2": dict(accumulation=2),
    "accumulate2-checkpointing": dict(accumulation=2, checkpointing=True),
    "manual": dict(manual=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fit_equal_with_callback(variant, spill_dir):
    options = dict(VARIANTS[variant])
    accumulation = options.pop("accumulation", 1)
    base = MLP(**options)
    reference = copy.deepcopy(base)
    fit(reference, accumulation=accumulation)

    module = copy.deepcopy(base)
    callback = OffloadCallback(budget_mb=0, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    trainer = fit(module, [callback], accumulation=accumulation)

    assert len(reference.losses) == SAMPLES // BATCH
    assert all(torch.equal(a, b) for a, b in zip(reference.losses, module.losses, strict=True))
    expected = dict(reference.named_parameters())
    for name, p in module.named_parameters():
        assert torch.equal(p, expected[name]), f"{variant}: final {name} differs"

    stats = callback.engine.stats  # readable after fit
    assert stats.saved_tensors > 0 and stats.offloaded_bytes > 0
    assert stats.offloaded_bytes == stats.saved_bytes  # budget 0: everything eligible moved
    assert stats.reloaded_bytes > 0  # and came back for backward (once per storage, or again for a user far apart)
    assert stats.peak_resident_bytes == 0
    assert files_under(spill_dir) == []  # closed at train end: no spill file left
    assert trainer.callback_metrics["offload_moved_mb"] > 0  # the last batch's figures were logged
    assert trainer.callback_metrics["offload_budget_mb"] == 0  # the budget in force


def test_every_closure_call_is_managed():
    """LBFGS re-runs its closure (training_step + backward) inside optimizer.step(): every one of
    those forwards saves through the engine, not only the first of each batch. A budget far above a
    step's saves, not None: the hooks count every forward (at budget None only the first step is
    counted: See Note: [no hooks where nothing moves] in offload/_memory/session.py)."""
    per_batch = OffloadCallback(budget_mb=KEEP_ALL_MB, min_offload_bytes=MIN_OFFLOAD_BYTES)
    fit(MLP(), [per_batch])
    per_forward = per_batch.engine.stats.saved_tensors / (SAMPLES // BATCH)

    module = MLP(lbfgs=True)
    callback = OffloadCallback(budget_mb=KEEP_ALL_MB, min_offload_bytes=MIN_OFFLOAD_BYTES)
    fit(module, [callback])
    assert len(module.losses) > SAMPLES // BATCH  # the closure ran more than once per batch
    assert callback.engine.stats.saved_tensors == per_forward * len(module.losses)


def test_validation_left_alone(spill_dir):
    """Validation during fit (and the sanity check before it) saves nothing through the engine."""
    callback = OffloadCallback(budget_mb=0, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    seen = []

    class Probe(lightning.Callback):
        def on_validation_epoch_start(self, trainer, pl_module):
            self.before = callback.engine.stats.saved_tensors if callback.engine is not None else None

        def on_validation_epoch_end(self, trainer, pl_module):
            with torch.enable_grad():  # a forward with grad on, outside any training batch
                pl_module(torch.randn(BATCH, WIDTH)).sum().backward()
            pl_module.zero_grad(set_to_none=True)
            after = callback.engine.stats.saved_tensors if callback.engine is not None else None
            seen.append((self.before, after))

    module = MLP()
    fit(module, [callback, Probe()], validate=True)
    assert len(seen) == 1 + SAMPLES // BATCH // 2  # the sanity check, then every 2 batches
    assert seen[0] == (None, None)  # the sanity check runs before the engine is made
    assert all(before == after for before, after in seen[1:]), seen
    assert callback.engine.stats.saved_tensors > 0
    assert files_under(spill_dir) == []


def test_epoch_cut_short_leaves_the_engine(spill_dir):
    """A module's on_train_batch_start returning -1 ends the epoch before on_train_batch_end runs:
    what follows (here a forward with grad in the module's on_train_epoch_end) runs outside the engine."""
    callback = OffloadCallback(budget_mb=0, min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir)
    seen = []

    class CutShort(MLP):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 1 else None

        def on_train_epoch_end(self):
            before = callback.engine.stats.saved_tensors
            self(torch.randn(BATCH, WIDTH)).sum().backward()
            self.zero_grad(set_to_none=True)
            seen.append((before, callback.engine.stats.saved_tensors))

    module = CutShort()
    fit(module, [callback])
    assert len(module.losses) == 1  # one batch trained, then the epoch was cut short
    assert len(seen) == 1 and seen[0][0] == seen[0][1] > 0, seen
    assert files_under(spill_dir) == []


def test_bad_engine_arguments_raise_at_construction():
    with pytest.raises(ValueError, match="budget_mb"):
        OffloadCallback(budget_mb=float("nan"))
    with pytest.raises(TypeError, match=r"'budgte_mb' \(did you mean 'budget_mb'\?\)"):
        OffloadCallback(budgte_mb=1)
    with pytest.raises(TypeError, match=r"'log_figure' \(did you mean 'log_figures'\?\).*, log_figures$"):
        OffloadCallback(log_figure=False)


def test_regions_named_from_the_module_it_holds(spill_dir):
    """regions= given as modules, without model=: the names come from the LightningModule the
    callback is handed, as explain() and the plan cache show them, not "region0", ..."""
    module = MLP()
    callback = OffloadCallback(
        budget_mb=0, regions=module.blocks, policy="recompute", min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir
    )
    fit(module, [callback])
    assert [name for name, _ in callback.engine.regions] == [f"blocks.{i}" for i in range(DEPTH)]
    assert callback.engine.stats.recomputed_regions == DEPTH * SAMPLES // BATCH


def test_regions_auto_from_the_module_it_holds(spill_dir):
    """regions="auto" needs nothing model-specific: the callback searches the LightningModule it
    is handed (its ``blocks``), names the regions from it, and the fit is exact."""
    base = MLP()
    reference = copy.deepcopy(base)
    fit(reference)
    module = copy.deepcopy(base)
    callback = OffloadCallback(
        budget_mb=0, regions="auto", policy="recompute", min_offload_bytes=MIN_OFFLOAD_BYTES, spill_dir=spill_dir
    )
    fit(module, [callback])
    assert all(torch.equal(a, b) for a, b in zip(reference.losses, module.losses, strict=True))
    assert [name for name, _ in callback.engine.regions] == [f"blocks.{i}" for i in range(DEPTH)]
    assert callback.engine.stats.recomputed_regions == DEPTH * SAMPLES // BATCH
    assert all("forward" not in block.__dict__ for block in module.blocks), "the blocks' own forwards are back"
