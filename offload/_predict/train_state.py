"""What a training step holds per parameter besides the parameter: gradients and optimizer state.

A prediction adds these to the device memory a step needs. The default is the common
mixed-precision setup with Adam (Rajbhandari et al. 2020, "ZeRO", arXiv 1910.02054, section 3.1:
2 bytes of fp16/bf16 parameter, 2 of gradient, and 4 + 4 + 4 of fp32 master weight and the two
moments, 16 bytes a parameter): gradients in the parameters' dtype, an fp32 master copy of each
parameter (none where the parameters are fp32 already), and Adam's two moments in fp32. Each is
settable (``predict(state=OptimizerState(...))``, ``--grad-dtype``, ``--master-dtype``,
``--moment-dtype`` on the command line).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["DTYPES", "MIXED_PRECISION", "OptimizerState", "dtype_name"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The dtypes the command line names, by their short names."""
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """ "bf16" for ``torch.bfloat16``, and so on; torch's name for any other."""
    return _NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerState:
    """Per parameter, what the step holds besides it (see the module docstring)."""

    grad_dtype: Optional[torch.dtype] = None
    """Gradients' dtype; None: the parameters' (what autograd makes)."""
    master_dtype: Optional[torch.dtype] = torch.float32
    """The optimizer's master copy of each parameter; None: none (the optimizer steps the
    parameters themselves). No copy is counted where it would be the parameters' own dtype."""
    moment_dtype: torch.dtype = torch.float32
    """Dtype of the optimizer's moments."""
    moments: int = 2
    """Moments per parameter: 2 for Adam and AdamW, 1 for SGD with momentum, 0 for plain SGD."""

    def __post_init__(self) -> None:
        for name in ("grad_dtype", "master_dtype", "moment_dtype"):
            value = getattr(self, name)
            if value is None and name != "moment_dtype":
                continue
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise TypeError(
                    f"OptimizerState.{name} must be a floating torch.dtype"
                    f"{' or None' if name != 'moment_dtype' else ''}, got {value!r}; e.g. torch.float32"
                )
        if isinstance(self.moments, bool) or not isinstance(self.moments, int) or self.moments < 0:
            raise ValueError(f"OptimizerState.moments must be an int >= 0 (2 for Adam), got {self.moments!r}")

    def bytes_per_parameter(self, param_dtype: torch.dtype) -> float:
        """Bytes held per parameter besides the parameter itself."""
        grad = (self.grad_dtype or param_dtype).itemsize
        master = self.master_dtype.itemsize if self.master_dtype not in (None, param_dtype) else 0
        return float(grad + master + self.moments * self.moment_dtype.itemsize)

    def describe(self, param_dtype: torch.dtype) -> str:
        """One line: what is held per parameter, in which dtypes."""
        grad = dtype_name(self.grad_dtype or param_dtype)
        master = (
            f"{dtype_name(self.master_dtype)} master weights"
            if self.master_dtype not in (None, param_dtype)
            else "no master weights"
        )
        moments = f"{self.moments} optimizer moment(s) {dtype_name(self.moment_dtype)}"
        return (
            f"{dtype_name(param_dtype)} parameters, {grad} gradients, {master}, {moments}: "
            f"{self.bytes_per_parameter(param_dtype):g} bytes per parameter besides it"
        )


MIXED_PRECISION = OptimizerState()
"""The default: gradients in the parameters' dtype, fp32 master weights, Adam's two moments in fp32."""
