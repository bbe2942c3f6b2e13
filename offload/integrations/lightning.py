"""``OffloadCallback`` for ``lightning.Trainer``: each training batch's forwards under one engine.

    trainer = lightning.Trainer(callbacks=[OffloadCallback(budget_mb=4096)])
    trainer.fit(module, data)

Lightning's hooks bracket the forward directly, so unlike the Hugging Face callback this one
wraps nothing: it enters the engine when a training batch starts and leaves it when the batch
ends, stepping out around backward (the engine's unpacks need no hooks installed).

    on_train_start        engine made (the LightningModule watched: its buffers never move)
    on_train_batch_start  enter ─┐ training_step: the forward saves through the engine
    on_before_backward    leave ─┘
    backward                      unpacks come back from the engine
    on_after_backward     enter ─┐ manual optimization's next forward, an optimizer closure
    on_train_batch_end    leave ─┘ re-run (LBFGS), the optimizer step (no_grad: saves nothing)
                          the engine's figures since the previous batch go to pl_module.log_dict
    validation, sanity check, predict: outside every bracket, left alone
    on_train_epoch_end,   leave (a module's on_train_batch_start returning -1 ends the epoch
    on_validation_start   before on_train_batch_end runs)
    on_train_end          engine closed (spill files gone); .engine stays readable after fit()
    on_exception          left and closed

Gradient accumulation (``accumulate_grad_batches``) runs the same brackets per batch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import offload

from .._api import check_keywords
from . import _figures

try:
    import lightning.pytorch as pl
except ImportError as error:
    raise ImportError("offload.integrations.lightning needs lightning: pip install 'offload[lightning]'") from error

__all__ = ["OffloadCallback"]


class OffloadCallback(pl.Callback):
    """Run the forwards of a ``lightning.Trainer``'s training batches under one offload engine.

    Takes the keyword arguments of :func:`offload.engine` (``budget_mb``, ``spill_dir``,
    ``regions``, ``policy``, ...); they are checked here, so a bad one raises the engine's own
    ``ValueError`` / ``TypeError`` now rather than when ``fit`` starts. The engine is made when
    training starts and closed when it ends; ``callback.engine`` and its ``stats`` stay readable
    after ``fit``. Each ``fit`` gets a fresh engine. ``log_figures=False`` logs nothing.
    """

    def __init__(self, *, log_figures: bool = True, **engine_kwargs: Any) -> None:
        check_keywords(engine_kwargs, where="OffloadCallback()", extra=("log_figures",))
        offload.engine(**engine_kwargs).close()  # the engine's own checks, at construction
        self._engine_kwargs = engine_kwargs
        self._log_figures = log_figures
        self.engine: Optional[offload.Engine] = None
        """The engine of the latest ``fit`` (closed once training ended); None before the first."""
        self._open = False
        """True from train start to train end: the engine is this fit's, and open (so not None)."""
        self._inside = False
        """True between entering the engine and leaving it (a bracket above is open)."""
        self._logged: Optional[offload.Stats] = None

    # ------------------------------------------------------------------ Lightning hooks

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()  # a previous fit that raised past on_exception
        # The module it holds names the regions (and regions="auto" searches it).
        self.engine = offload.engine(**({"model": pl_module} | self._engine_kwargs))
        self._logged = self.engine.stats
        self._open = True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._enter()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._leave()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._leave()
        if self._log_figures and self._open:
            assert self.engine is not None and self._logged is not None  # set by on_train_start
            now = self.engine.stats
            pl_module.log_dict(_figures.log_figures(self._logged, now), on_step=True, on_epoch=False)
            self._logged = now

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish()

    # ------------------------------------------------------------------ the bracket

    def _enter(self) -> None:
        if self._open and not self._inside:
            assert self.engine is not None  # _open: on_train_start made it
            self.engine.__enter__()
            self._inside = True

    def _leave(self) -> None:
        if self._inside:
            self._inside = False
            assert self.engine is not None  # _inside: _enter() entered it
            self.engine.__exit__(None, None, None)

    def _finish(self) -> None:
        """Leave the engine if inside it and close it (idempotent)."""
        self._leave()
        if self._open:
            self._open = False
            assert self.engine is not None  # _open: on_train_start made it
            self.engine.close()
