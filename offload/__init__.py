"""offload: activation memory as a budget, not a wall.

    import offload
    with offload.engine(budget_mb=512):
        loss = model(batch)
    loss.backward()

Per region, measured: ``offload.engine(budget_mb=512, regions=model.blocks)`` profiles each block
on its first steps and keeps, offloads or recomputes it, whichever is cheapest under the budget.
"""

from ._api import engine
from ._config import Config
from ._cost import MachineProfile, RegionProfile, Scope
from ._engine import Engine, explain
from ._errors import OffloadError
from ._memory.hooks import no_offload
from ._memory.probe import probe
from ._memory.sharded import sharded
from ._plan.planner import Decision, Plan
from ._plan.policy import Policy, register_policy
from ._plan.policy import policy_names as policies
from ._plan.profiler import LIMITS as limits
from ._plan.profiler import ProfilingLimits
from ._predict.machines import Machine
from ._predict.machines import get_machine as machine
from ._predict.machines import machine_names as machines
from ._predict.predict import OptimizerState, Prediction, predict
from ._regions.recompute import checkpoint
from ._stats import Stats
from ._version import __version__ as __version__
from .seams import Seams

__all__ = [
    "Config",
    "Decision",
    "Engine",
    "Machine",
    "MachineProfile",
    "OffloadError",
    "OptimizerState",
    "Plan",
    "Policy",
    "Prediction",
    "ProfilingLimits",
    "RegionProfile",
    "Scope",
    "Seams",
    "Stats",
    "checkpoint",
    "engine",
    "explain",
    "limits",
    "machine",
    "machines",
    "no_offload",
    "policies",
    "predict",
    "probe",
    "register_policy",
    "sharded",
]
