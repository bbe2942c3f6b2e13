"""Named machines, as plain numbers: what a prediction for a GPU needs to know of it without one.

A ``Machine`` holds the vendor's peak figures (dense bf16 FLOP/s, HBM bandwidth, host link
bandwidth per direction and both directions at once, the GPU interconnect per direction), its
device memory as the device reports it, and the ``Assumptions`` a prediction makes of them: which
fraction of each peak a training step achieves (the matmuls, fused attention kernels, memory-bound
ops, copies, collectives), how much of a sharded step's collectives it waits on, the fixed cost of
one op, the engine's host costs (per saved tensor, per op under a dispatch mode), and what the
CUDA context and the caching allocator take of the device's memory.
Peaks are facts with a source (the datasheet named in ``source``); device memory is what the device
reports (``memory_source``); the compute efficiency of each GPU and the exposed fraction of its
collectives were calibrated on published training runs (``Assumptions.flops_source`` names them;
``bench/results/predict-published.md`` holds the runs and the check); fused attention's fraction
is FlashAttention-2's published one (``attention_source``); the other fractions and costs are
assumptions, named as such and overridable (``with_assumptions``), never measured here. A variant
the table does not name is a named machine with some figures replaced (``replace``: a power-capped or
96 GB part, a cloud's own, a cluster's network between nodes), each replaced figure listed in
``given`` and marked so in the printout; ``python -m offload predict``'s machine flags do the same.

    Machine ──achieved_flops(), achieved_memory_gb_per_s()──▶ roofline per op (``count``)
            ├─usable_memory_bytes()──▶ "does it fit on this device"
            └─machine_profile()──▶ MachineProfile ──▶ planner (the link's achieved bandwidth)

The machine at hand comes from measurements instead (``Machine.from_probe``): ``offload.probe()``'s link
figures plus a measured compute rate and copy bandwidth, with every fraction 1 (they are already
what was achieved; ``this_cpu`` scales them to a timed reference step and records the
factor in ``compute_scale``). Nothing here touches torch or a device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from .._cost import MachineProfile

__all__ = ["MACHINES", "Assumptions", "Machine", "get_machine", "machine_names"]

_GB = 1e9
"""Bandwidths count GB of 1e9 bytes (as ``MachineProfile`` does)."""
_MIB = 1 << 20
"""Device memory counts MiB, as ``nvidia-smi`` and ``torch.cuda.get_device_properties`` report it."""
_TFLOPS = 1e12
_NOT_REPLACED = ("given", "assumptions", "compute_scale")
"""Fields ``Machine.replace`` does not set: its own record, ``with_assumptions``' and a measurement's."""
_DESCRIPTIONS = ("name", "source", "memory_source", "link", "interconnect", "internode", "device_type")
"""Fields that say what a figure is rather than being one: never marked given."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Assumptions:
    """What a prediction assumes of a machine beyond its datasheet. The defaults are round figures
    for large transformer layers, not measurements; each named machine carries its own compute
    efficiency (``flops_fraction``, calibrated, with ``flops_source``); pass your own to
    ``Machine.with_assumptions``."""

    flops_fraction: float = 0.6
    """Fraction of peak dense FLOP/s a training step's matmuls achieve on this machine. Named
    machines carry one calibrated on published runs (``flops_source``); 0.6 is a round figure."""
    flops_source: str = "a round figure (0.6), not calibrated"
    """Where ``flops_fraction`` comes from: the published runs it was calibrated on, or who set it."""
    attention_fraction: Optional[float] = None
    """Fraction of peak dense FLOP/s a fused attention kernel (SDPA's flash, memory-efficient or
    cuDNN kernel, forward and backward) achieves; None: as the matmuls (``flops_fraction``). Named
    GPUs carry FlashAttention-2's published figure (``attention_source``): attention kernels reach
    less of a GPU's peak than large matmuls, the more so on Hopper."""
    attention_source: str = "as the matmuls (flops_fraction)"
    """Where ``attention_fraction`` comes from."""
    collective_fraction: float = 0.8
    """Fraction of the GPU interconnect's figure per direction (``Machine.interconnect_gb_per_s``)
    a large all-gather or reduce-scatter achieves: an assumption, as ``link_fraction`` is."""
    exposed_fraction: float = 1.0
    """Of a sharded step's collective time (``predict(sharded_over=N)``), the fraction added to the
    step: 1 adds all of it, as if nothing hid it. Named GPUs carry one fitted with
    ``flops_fraction`` on published FSDP runs (``flops_source``): a fitted term in proportion to the
    bytes the collectives move, not a measured overlap (``sharding`` says what it stands for)."""
    memory_fraction: float = 0.8
    """Fraction of peak HBM bandwidth a memory-bound op (elementwise, norm, softmax) achieves."""
    link_fraction: float = 0.8
    """Fraction of the host link's figure per direction that a pinned copy achieves (1 where the
    machine's link figures are measured copies already)."""
    op_overhead_us: float = 4.0
    """Fixed cost of one op (kernel launch and dispatch), microseconds: what a tiny op costs."""
    per_tensor_overhead_us: float = 10.0
    """The engine's fixed cost per saved tensor it moves (pack, unpack, pool lookup, event), us;
    the planner's ``MachineProfile.per_tensor_overhead_us``."""
    held_tensor_overhead_us: float = 15.0
    """The engine's host cost per saved tensor its store takes, kept or moved (the Python pack and
    unpack hooks and the store's bookkeeping), us; the planner's
    ``MachineProfile.held_tensor_overhead_us``. An assumption: a host CPU's Python costs the same
    order on a GPU machine as on the 2-core Xeon VM of ``bench/results/overhead-cpu.json`` (~17 us
    at budget None); charged in full, though where the GPU's queue runs ahead of the host it hides."""
    dispatch_overhead_us: float = 5.0
    """Host cost of one op dispatched under a Python ``TorchDispatchMode`` (a selective region's
    stash and replay modes), us; the planner's ``MachineProfile.dispatch_overhead_us``. Measured on
    a CPU, not on a GPU machine's host: ``this_cpu._dispatch_overhead_us`` took 4.2-5.3 us
    an op in the runs of ``bench/predict_published.py`` on the 2-vCPU Xeon VM with torch 2.13
    (``bench/results/predict-published.md`` records its latest three); a GPU machine's host runs
    the same Python per op."""
    context_mib: float = 400.0
    """Device memory the CUDA context takes before the first tensor, MiB: "around 400MB if CUDA
    >= 11.7 is used and lazy module loading enabled (default in PyTorch)" (a PyTorch maintainer,
    https://github.com/pytorch/pytorch/issues/109888). 0 on a CPU."""
    allocator_fraction: float = 0.05
    """Fraction of the device's memory the caching allocator holds without handing it out
    (blocks rounded up, fragments between them, cuBLAS workspaces). An assumption, not a
    measurement: it depends on the model and the allocator's settings (expandable segments take
    less). 0 on a CPU."""

    def __post_init__(self) -> None:
        for name in ("flops_fraction", "memory_fraction", "link_fraction", "collective_fraction", "attention_fraction"):
            value = getattr(self, name)
            if value is None and name == "attention_fraction":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"Assumptions.{name} must be a number in (0, 1], got {value!r}; 1 means the peak")
        exposed = self.exposed_fraction
        if isinstance(exposed, bool) or not isinstance(exposed, (int, float)) or not 0 <= exposed <= 1:
            raise ValueError(
                f"Assumptions.exposed_fraction must be a number in [0, 1], got {exposed!r}; "
                "1 means the step waits on all of its collectives, 0 that compute hides them"
            )
        allocator = self.allocator_fraction
        if isinstance(allocator, bool) or not isinstance(allocator, (int, float)) or not 0 <= allocator < 1:
            raise ValueError(
                f"Assumptions.allocator_fraction must be a number in [0, 1), got {self.allocator_fraction!r}; "
                "0 means the allocator hands out every byte"
            )
        for name in (
            "op_overhead_us",
            "per_tensor_overhead_us",
            "held_tensor_overhead_us",
            "dispatch_overhead_us",
            "context_mib",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value >= 0)
            ):
                unit = "MiB" if name.endswith("_mib") else "microseconds"
                raise ValueError(f"Assumptions.{name} must be a finite number >= 0 ({unit}), got {value!r}")
        for name in ("flops_source", "attention_source"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Assumptions.{name} must be a string, got {getattr(self, name)!r}")


MEASURED = Assumptions(
    flops_fraction=1.0,
    flops_source="measured here",
    attention_fraction=None,
    attention_source="as the measured matmul rate",
    memory_fraction=1.0,
    link_fraction=1.0,
    context_mib=0.0,
    allocator_fraction=0.0,
)
"""The fractions of a machine whose figures were measured (``Machine.from_probe``): already achieved."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Machine:
    """One machine's figures (see the module docstring). Bandwidths in GB/s of 1e9 bytes."""

    name: str
    device_type: str
    """``"cuda"`` or ``"cpu"``: what sits behind the link (pinned host memory, or the spill disk)."""
    peak_flops: float
    """Peak dense bf16 FLOP/s (without structured sparsity)."""
    memory_gb_per_s: float
    """Peak device memory (HBM) bandwidth."""
    memory_bytes: int
    """Device memory, bytes, as the device reports it (``nvidia-smi``'s total in MiB x 2**20)."""
    link_out_gb_per_s: float
    """Host link, device to host, one direction alone (CPU: the spill disk's write)."""
    link_back_gb_per_s: float
    """Host link, host to device, one direction alone (CPU: the spill disk's read)."""
    link_both_gb_per_s: float
    """Host link, both directions at once, summed (the datasheet's "bidirectional" figure)."""
    link: str
    """What the link is: "PCIe Gen5 x16", "NVLink-C2C", "spill disk"."""
    source: str
    """Where the figures come from: datasheet name and URL, or "measured here"."""
    memory_source: str = ""
    """Where ``memory_bytes`` comes from: a device's report, with its URL."""
    assumptions: Assumptions = Assumptions()
    spare_cores: int = 0
    """CPU only: cores beyond torch's threads, free for the spill threads
    (``MachineProfile.spare_cores``; ``Machine.from_probe`` takes the probe's)."""
    interconnect_gb_per_s: Optional[float] = None
    """GPU to GPU within one node, one direction (NVLink), GB/s, as the datasheet gives it: what a
    sharded step's collectives run over (``predict(sharded_over=N)``). None: not known (a CPU, a
    probed machine)."""
    interconnect: str = ""
    """What the interconnect is: "NVLink 3 (12 links)"."""
    peak_fp8_flops: Optional[float] = None
    """Peak dense fp8 FLOP/s (without structured sparsity); None: no fp8 tensor cores, or not given.
    Recorded and printed; a step is priced at ``peak_flops`` (bf16), as the fake step runs it."""
    gpus_per_node: int = 1
    """GPUs in one node joined by ``interconnect``: a sharded step over more crosses the network
    between nodes (``internode_gb_per_s``)."""
    internode_gb_per_s: Optional[float] = None
    """Between nodes, per GPU, one direction, GB/s: the node's network adapters' line rate shared
    out per GPU (8 x 400 Gb/s ConnectX-7 for 8 GPUs: 50). None: not known."""
    internode: str = ""
    """What the network between nodes is: "8 x ConnectX-7 400 Gb/s"."""
    given: tuple[str, ...] = ()
    """The fields set by ``replace`` (or ``python -m offload predict``'s machine flags) rather than
    taken from ``source``: the printout marks them "given"."""
    compute_scale: float = 1.0
    """A measured machine: the factor its microbenchmarked FLOP/s and memory bandwidth were scaled
    by to price a timed reference step as long as it took (``this_cpu.calibrate_compute``);
    1 for a named machine and an uncalibrated measurement."""

    @classmethod
    def from_probe(
        cls,
        profile: MachineProfile,
        *,
        flops: float,
        memory_gb_per_s: float,
        memory_bytes: int,
        op_overhead_us: float,
        held_tensor_overhead_us: float = 0.0,
        dispatch_overhead_us: float = 0.0,
    ) -> "Machine":
        """The machine ``profile`` (from ``offload.probe()``) was measured on, as a ``Machine``: its
        link (device <-> host on CUDA, the spill disk on the CPU) and per-tensor cost from the probe,
        with the matmul rate ``flops`` (FLOP/s), copy bandwidth, per-op cost and the engine's host
        costs (``Assumptions``; 0: not measured, not charged) measured beside it.
        Every fraction is 1: the figures are what was achieved. Both directions at once were not
        measured: twice the slower one stands for it (the planner does not read it)."""
        out_gb_per_s, back_gb_per_s = profile.offload_gb_per_s()
        if not (out_gb_per_s > 0 and back_gb_per_s > 0):
            raise ValueError(
                f"the probe measured an unusable link ({out_gb_per_s} GB/s out, {back_gb_per_s} GB/s back); "
                "run offload.probe(refresh=True), or pass a named machine"
            )
        return cls(
            name=f"probe:{profile.device_type}:{profile.device_name}" if profile.device_name else "probe",
            device_type=profile.device_type,
            peak_flops=flops,
            memory_gb_per_s=memory_gb_per_s,
            memory_bytes=memory_bytes,
            link_out_gb_per_s=out_gb_per_s,
            link_back_gb_per_s=back_gb_per_s,
            link_both_gb_per_s=2 * min(out_gb_per_s, back_gb_per_s),
            link="spill disk" if profile.device_type == "cpu" else "device <-> pinned host",
            source="measured here: offload.probe() for the link; a timed matmul, copy and tiny op for the compute",
            memory_source="this machine's RAM (psutil)",
            assumptions=dataclasses.replace(
                MEASURED,
                op_overhead_us=op_overhead_us,
                per_tensor_overhead_us=profile.per_tensor_overhead_us,
                held_tensor_overhead_us=held_tensor_overhead_us,
                dispatch_overhead_us=dispatch_overhead_us,
            ),
            spare_cores=profile.spare_cores,
        )

    def __post_init__(self) -> None:
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"Machine.device_type must be 'cuda' or 'cpu', got {self.device_type!r}")
        if isinstance(self.spare_cores, bool) or not isinstance(self.spare_cores, int) or self.spare_cores < 0:
            raise ValueError(f"Machine {self.name!r}: spare_cores must be an int >= 0, got {self.spare_cores!r}")
        scale = self.compute_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"Machine {self.name!r}: compute_scale must be a finite number > 0, got {scale!r}")
        for name in ("peak_flops", "memory_gb_per_s", "link_out_gb_per_s", "link_back_gb_per_s", "link_both_gb_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Machine {self.name!r}: {name} must be a finite number > 0, got {value!r}")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise ValueError(f"Machine {self.name!r}: memory_bytes must be an int > 0, got {self.memory_bytes!r}")
        for name in ("interconnect_gb_per_s", "internode_gb_per_s", "peak_fp8_flops"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
            ):
                raise ValueError(f"Machine {self.name!r}: {name} must be a finite number > 0 or None, got {value!r}")
        gpus = self.gpus_per_node
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"Machine {self.name!r}: gpus_per_node must be an int >= 1, got {gpus!r}")

    def achieved_flops(self) -> float:
        """FLOP/s a matmul achieves: peak x ``flops_fraction``."""
        return self.peak_flops * self.assumptions.flops_fraction

    def achieved_attention_flops(self) -> float:
        """FLOP/s a fused attention kernel achieves: peak x ``attention_fraction`` (or ``flops_fraction``)."""
        a = self.assumptions
        return self.peak_flops * (a.flops_fraction if a.attention_fraction is None else a.attention_fraction)

    def achieved_collective_gb_per_s(self) -> Optional[float]:
        """GB/s a large all-gather or reduce-scatter achieves over the interconnect, per direction;
        None where the interconnect is not known."""
        if self.interconnect_gb_per_s is None:
            return None
        return self.interconnect_gb_per_s * self.assumptions.collective_fraction

    def achieved_memory_gb_per_s(self) -> float:
        """Bandwidth a memory-bound op achieves: peak x ``memory_fraction``."""
        return self.memory_gb_per_s * self.assumptions.memory_fraction

    def usable_memory_bytes(self) -> int:
        """Device memory a training step can have: what the device reports, less the CUDA context
        (``Assumptions.context_mib``) and what the caching allocator holds back
        (``Assumptions.allocator_fraction``)."""
        a = self.assumptions
        return max(0, int(self.memory_bytes * (1 - a.allocator_fraction) - a.context_mib * _MIB))

    def achieved_link_gb_per_s(self) -> tuple[float, float, float]:
        """(out alone, back alone, each direction while both run), GB/s, the engine's copies achieve."""
        fraction = self.assumptions.link_fraction
        return (
            self.link_out_gb_per_s * fraction,
            self.link_back_gb_per_s * fraction,
            self.link_both_gb_per_s / 2 * fraction,
        )

    def machine_profile(self) -> MachineProfile:
        """What the planner reads: the link's achieved bandwidth each way and the host costs.
        The planner's timeline runs copies out in the forward and reloads in the backward, each
        direction mostly alone, so it gets the one-direction figures."""
        out_gb_per_s, back_gb_per_s, _ = self.achieved_link_gb_per_s()
        host = MachineProfile(
            device_type=self.device_type,
            device_name=self.name,
            per_tensor_overhead_us=self.assumptions.per_tensor_overhead_us,
            held_tensor_overhead_us=self.assumptions.held_tensor_overhead_us,
            dispatch_overhead_us=self.assumptions.dispatch_overhead_us,
        )
        if self.device_type == "cpu":
            return dataclasses.replace(
                host, disk_write_gb_per_s=out_gb_per_s, disk_read_gb_per_s=back_gb_per_s, spare_cores=self.spare_cores
            )
        return dataclasses.replace(host, d2h_gb_per_s=out_gb_per_s, h2d_gb_per_s=back_gb_per_s)

    def with_interconnect(self, gb_per_s: float, what: str, *, gpus_per_node: int = 8) -> Machine:
        """This machine with a GPU interconnect of ``gb_per_s`` GB/s a direction, described as
        ``what``, joining ``gpus_per_node`` GPUs (default 8, an HGX board's NVLink domain): for
        ``predict(sharded_over=N)`` on a machine whose figure is not known (a probed one) or is
        another than the named one's. Marked given, as ``replace`` marks what it sets."""
        return self.replace(interconnect_gb_per_s=gb_per_s, interconnect=what, gpus_per_node=gpus_per_node)

    def replace(self, **changes: Any) -> Machine:
        """This machine with some of its figures replaced, each marked given in ``given`` and the
        printout: a variant the table does not name (a power-capped H100, a cloud's own part, a
        cluster's own network), e.g. ``offload.machine("h100-sxm").replace(name="h100-capped",
        peak_flops=700e12, internode_gb_per_s=25, internode="4 x 400 Gb/s for 8 GPUs")``. Units as
        the fields': FLOP/s, GB/s of 1e9 bytes, bytes. A ``ValueError`` names an unknown field and
        lists the valid ones; every value is checked as a named machine's is. ``assumptions`` are
        changed with ``with_assumptions``."""
        names = [f.name for f in dataclasses.fields(Machine) if f.name not in _NOT_REPLACED]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(
                f"Machine.replace: unknown fields {unknown}; valid ones are: {', '.join(names)} "
                "(assumptions: machine.with_assumptions(...))"
            )
        given = tuple(dict.fromkeys((*self.given, *(n for n in changes if n not in _DESCRIPTIONS))))
        return dataclasses.replace(self, **changes, given=given)

    def figure_source(self, name: str) -> str:
        """Where the figure ``name`` comes from: "given" where ``replace`` set it, else ``source``."""
        return "given" if name in self.given else self.source

    def with_assumptions(self, **changes: Optional[float | str]) -> Machine:
        """This machine with some assumptions replaced, e.g. ``flops_fraction=0.45`` (its
        ``flops_source`` then says it was given, unless given too)."""
        names = [f.name for f in dataclasses.fields(Assumptions)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(f"unknown assumptions {unknown}; valid ones are: {', '.join(names)}")
        for fraction, source in (("flops_fraction", "flops_source"), ("attention_fraction", "attention_source")):
            if fraction in changes and source not in changes:
                given = changes[fraction]
                changes[source] = "as the matmuls (given)" if given is None else f"given ({given})"
        return dataclasses.replace(self, assumptions=dataclasses.replace(self.assumptions, **changes))  # type: ignore[arg-type]  # validated by Assumptions


_A100_SOURCE = (
    "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column): BF16 312 TFLOPS dense, HBM2e 2,039 GB/s, "
    "80 GB; PCIe Gen4 x16 64 GB/s bidirectional; NVLink 600 GB/s; https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
    "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_H100_SOURCE = (
    "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 (SXM) / 1,513 (PCIe) TFLOPS with sparsity, half that "
    "dense; HBM3 3.35 TB/s (SXM), HBM2e 2 TB/s (PCIe); 80 GB; PCIe Gen5 128 GB/s bidirectional; NVLink 900 GB/s "
    "(SXM), 600 GB/s (PCIe: a bridge between two GPUs); "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_H200_SOURCE = (
    "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 1,979 TFLOPS with sparsity (989 dense), HBM3e "
    "4.8 TB/s, 141 GB; PCIe Gen5 128 GB/s bidirectional; NVLink 900 GB/s; https://www.nvidia.com/en-us/data-center/h200/"
)
_GH200_SOURCE = (
    "NVIDIA GH200 Grace Hopper Superchip datasheet (96 GB HBM3 version): H100 GPU, BF16 1,979 TFLOPS with "
    "sparsity (989 dense), HBM3 4 TB/s; NVLink-C2C 900 GB/s bidirectional to the Grace CPU's LPDDR5X; "
    "https://resources.nvidia.com/en-us-grace-cpu/grace-hopper-superchip. Link as measured, each way alone: "
    "host to device 346 GB/s (copy engine, nvbandwidth; https://github.com/NVIDIA/nvbandwidth/issues/23), device "
    "to host 300 GB/s (the same report: host to device is ~15 % faster; Fusco et al., arXiv 2408.11556, measured "
    "297 GB/s on the Alps GH200). GPU to GPU: not given (a node has one GH200; machine.with_interconnect "
    "sets one)"
)

_A100_VARIANTS_SOURCE = (
    "NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM and A100 80GB PCIe columns): BF16 312 TFLOPS dense; "
    "HBM2 1,555 GB/s (40GB SXM), HBM2e 1,935 GB/s (80GB PCIe); PCIe Gen4 x16 64 GB/s bidirectional; NVLink 600 GB/s "
    "(SXM), an NVLink bridge for 2 GPUs 600 GB/s (PCIe); https://www.nvidia.com/content/dam/en-zz/Solutions/"
    "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_H100_NVL_SOURCE = (
    "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL column): BF16 1,671 TFLOPS and FP8 3,341 TFLOPS with "
    "sparsity, half that dense; HBM3 94 GB at 3.9 TB/s; PCIe Gen5 128 GB/s bidirectional; NVLink bridge 600 GB/s "
    "(pairs of GPUs); https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_L40S_SOURCE = (
    "NVIDIA L40S GPU datasheet: BF16 362.05 TFLOPS dense (733 with sparsity), FP8 733 dense (1,466 with "
    "sparsity); 48 GB GDDR6 at 864 GB/s; PCIe Gen4 x16 64 GB/s bidirectional; no NVLink; "
    "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"
)
_MI300X_SOURCE = (
    "AMD Instinct MI300X accelerator data sheet: peak BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity), FP8 "
    "2,614.9 dense; 192 GB HBM3 at 5.3 TB/s; PCIe Gen5 x16 128 GB/s; 7 AMD Infinity Fabric links of 128 GB/s "
    "each (bidirectional), 896 GB/s in all, one to each of the other 7 GPUs of an 8-GPU platform; "
    "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf"
)
_DGX_A100_NETWORK = (
    "NVIDIA DGX A100 datasheet: 8 single-port Mellanox ConnectX-6 VPI 200 Gb/s HDR InfiniBand for compute, "
    "one per GPU: 25 GB/s a GPU a direction; https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
    "nvidia-dgx-a100-datasheet.pdf"
)
_DGX_H100_NETWORK = (
    "NVIDIA DGX H100/H200 datasheet: 8 single-port NVIDIA ConnectX-7 VPI 400 Gb/s InfiniBand/Ethernet (4 OSFP "
    "ports), one per GPU: 50 GB/s a GPU a direction; https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx"
)

# Device memory as the device reports it (nvidia-smi's total, MiB).
_H100_MEMORY = (
    "nvidia-smi: 81559MiB on an H100 80GB HBM3 (SXM), https://github.com/NVIDIA/nccl/issues/1264, and on "
    "Modal's H100s, https://github.com/modal-labs/modal-client/pull/2797"
)
_H100_PCIE_MEMORY = (
    "nvidia-smi: 81559MiB on an H100 PCIe: not found in a report with an address here; the H100 SXM's figure, "
    "the same 80 GB of HBM"
)
_A100_MEMORY = "nvidia-smi: 81920MiB on an A100 80GB, https://github.com/modal-labs/modal-client/pull/2797"
_H200_MEMORY = "nvidia-smi: 143771MiB on an H200, https://github.com/NVIDIA/cuda-samples/issues/311"
_DATASHEET_MEMORY = (
    "no device report of its total found with an address here: the datasheet's {gb} GB taken as {gb}e9 bytes "
    "(devices report more than their datasheet's decimal GB: an H100 80GB reports 81559 MiB)"
)
_A100_40GB_MEMORY = (
    "nvidia-smi: 40960MiB on an A100 40GB, as the 80 GB reports 81920MiB: not found in a report with an address "
    "here; half the 80 GB's figure, the datasheet's 40 GB of HBM2"
)
_GH200_MEMORY = (
    "no report of nvidia-smi's total found for the 96 GB GH200: the datasheet's 96 GB, 96e9 bytes (an H100 80GB "
    "reports more than its datasheet's 80e9)"
)

# The compute efficiency of each GPU: calibrated by bench/predict_published.py on the calibration
# half of the published runs in bench/results/predict-published.md (the other half is the check).
_A100_FLOPS, _A100_EXPOSED = 0.74, 0.65
_H100_FLOPS, _H100_EXPOSED = 0.59, 0.7
_LLM_FOUNDRY = (
    "https://github.com/mosaicml/llm-foundry/blob/061f2c7ce64e655100286584a7629e2a09f827ba/scripts/train/"
    "benchmarking/README.md"
)
_FLASH_ATTENTION_2 = (
    "FlashAttention-2 reaches 50-73 % of the A100's peak (Dao 2023, arXiv 2307.08691, abstract), 0.6 taken; "
    "torch's SDPA flash kernel is FlashAttention-2's"
)
_FLASH_ATTENTION_2_HOPPER = (
    "FlashAttention-2 reaches 35 % of the H100's peak (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, "
    "abstract); torch's SDPA flash kernel is FlashAttention-2's"
)
_A100_EFFICIENCY = Assumptions(
    flops_fraction=_A100_FLOPS,
    exposed_fraction=_A100_EXPOSED,
    flops_source=(
        "calibrated, with the exposed fraction of FSDP's collectives, on MosaicML's A100 80GB bf16 FSDP runs of "
        f"MPT 1b, 3b, 7b, 13b and 30b at sequence 2048 on 8 GPUs (tokens/s/GPU as published, {_LLM_FOUNDRY}; their "
        "Triton attention kernel priced at its own published efficiency); checked on their other runs: "
        "bench/results/predict-published.md"
    ),
    attention_fraction=0.6,
    attention_source=_FLASH_ATTENTION_2,
)
_H100_EFFICIENCY = Assumptions(
    flops_fraction=_H100_FLOPS,
    exposed_fraction=_H100_EXPOSED,
    flops_source=(
        "calibrated, with the exposed fraction of FSDP's collectives, on MosaicML's H100 80GB bf16 FSDP runs of "
        f"MPT 1b, 7b, 13b and 30b at sequence 2048 and 3b at 4096 on 8 GPUs (tokens/s/GPU as published, "
        f"{_LLM_FOUNDRY}; their Triton attention kernel priced at its own efficiency); checked on their other runs: "
        "bench/results/predict-published.md"
    ),
    attention_fraction=0.35,
    attention_source=_FLASH_ATTENTION_2_HOPPER,
)
_HOPPER_UNCALIBRATED = (
    "the H100 SXM's figure, not calibrated on this machine: no published training run of it was found; its "
    "SMs are the H100's"
)
_AMPERE_UNCALIBRATED = (
    "the A100 80GB SXM's figure, not calibrated on this machine: no published training run of it was found; "
    "its SMs are the A100's"
)
_UNCALIBRATED = Assumptions(
    flops_source="a round figure (0.6), not calibrated: no published training run of this GPU was fitted"
)

MACHINES: dict[str, Machine] = {
    m.name: m
    for m in (
        Machine(
            name="a100-80gb-sxm",
            device_type="cuda",
            peak_flops=312 * _TFLOPS,
            memory_gb_per_s=2039,
            memory_bytes=81920 * _MIB,
            link_out_gb_per_s=32,
            link_back_gb_per_s=32,
            link_both_gb_per_s=64,
            link="PCIe Gen4 x16",
            interconnect_gb_per_s=300,
            interconnect="NVLink 3 (600 GB/s both ways)",
            gpus_per_node=8,
            internode_gb_per_s=25,
            internode="8 x ConnectX-6 200 Gb/s, one a GPU (DGX A100)",
            source=f"{_A100_SOURCE}; between nodes: {_DGX_A100_NETWORK}",
            memory_source=_A100_MEMORY,
            assumptions=_A100_EFFICIENCY,
        ),
        Machine(
            name="a100-40gb-sxm",
            device_type="cuda",
            peak_flops=312 * _TFLOPS,
            memory_gb_per_s=1555,
            memory_bytes=40960 * _MIB,
            link_out_gb_per_s=32,
            link_back_gb_per_s=32,
            link_both_gb_per_s=64,
            link="PCIe Gen4 x16",
            interconnect_gb_per_s=300,
            interconnect="NVLink 3 (600 GB/s both ways)",
            gpus_per_node=8,
            internode_gb_per_s=25,
            internode="8 x ConnectX-6 200 Gb/s, one a GPU (DGX A100)",
            source=f"{_A100_VARIANTS_SOURCE}; between nodes: {_DGX_A100_NETWORK}",
            memory_source=_A100_40GB_MEMORY,
            assumptions=dataclasses.replace(_A100_EFFICIENCY, flops_source=_AMPERE_UNCALIBRATED),
        ),
        Machine(
            name="a100-80gb-pcie",
            device_type="cuda",
            peak_flops=312 * _TFLOPS,
            memory_gb_per_s=1935,
            memory_bytes=81920 * _MIB,
            link_out_gb_per_s=32,
            link_back_gb_per_s=32,
            link_both_gb_per_s=64,
            link="PCIe Gen4 x16",
            interconnect_gb_per_s=32,
            interconnect="PCIe Gen4 x16 (its NVLink bridge joins pairs of GPUs only)",
            gpus_per_node=8,
            source=_A100_VARIANTS_SOURCE,
            memory_source=_A100_MEMORY,
            assumptions=dataclasses.replace(_A100_EFFICIENCY, flops_source=_AMPERE_UNCALIBRATED),
        ),
        Machine(
            name="h100-sxm",
            device_type="cuda",
            peak_flops=989 * _TFLOPS,
            memory_gb_per_s=3350,
            memory_bytes=81559 * _MIB,
            link_out_gb_per_s=64,
            link_back_gb_per_s=64,
            link_both_gb_per_s=128,
            link="PCIe Gen5 x16",
            interconnect_gb_per_s=450,
            interconnect="NVLink 4 (900 GB/s both ways)",
            peak_fp8_flops=1979 * _TFLOPS,
            gpus_per_node=8,
            internode_gb_per_s=50,
            internode="8 x ConnectX-7 400 Gb/s, one a GPU (DGX H100)",
            source=f"{_H100_SOURCE}; between nodes: {_DGX_H100_NETWORK}",
            memory_source=_H100_MEMORY,
            assumptions=_H100_EFFICIENCY,
        ),
        Machine(
            name="h100-pcie",
            device_type="cuda",
            peak_flops=756 * _TFLOPS,
            memory_gb_per_s=2000,
            memory_bytes=81559 * _MIB,
            link_out_gb_per_s=64,
            link_back_gb_per_s=64,
            link_both_gb_per_s=128,
            link="PCIe Gen5 x16",
            interconnect_gb_per_s=64,
            interconnect="PCIe Gen5 x16 (its NVLink bridge joins pairs of GPUs only)",
            peak_fp8_flops=1513 * _TFLOPS,
            gpus_per_node=8,
            source=_H100_SOURCE,
            memory_source=_H100_PCIE_MEMORY,
            assumptions=dataclasses.replace(_H100_EFFICIENCY, flops_source=_HOPPER_UNCALIBRATED),
        ),
        Machine(
            name="h200",
            device_type="cuda",
            peak_flops=989 * _TFLOPS,
            memory_gb_per_s=4800,
            memory_bytes=143771 * _MIB,
            link_out_gb_per_s=64,
            link_back_gb_per_s=64,
            link_both_gb_per_s=128,
            link="PCIe Gen5 x16",
            interconnect_gb_per_s=450,
            interconnect="NVLink 4 (900 GB/s both ways)",
            peak_fp8_flops=1979 * _TFLOPS,
            gpus_per_node=8,
            internode_gb_per_s=50,
            internode="8 x ConnectX-7 400 Gb/s, one a GPU (DGX H200)",
            source=f"{_H200_SOURCE}; between nodes: {_DGX_H100_NETWORK}",
            memory_source=_H200_MEMORY,
            assumptions=dataclasses.replace(_H100_EFFICIENCY, flops_source=_HOPPER_UNCALIBRATED),
        ),
        Machine(
            name="gh200",
            device_type="cuda",
            peak_flops=989 * _TFLOPS,
            memory_gb_per_s=4000,
            memory_bytes=96 * 10**9,
            link_out_gb_per_s=300,
            link_back_gb_per_s=346,
            link_both_gb_per_s=600,  # not measured: twice the slower direction, as Machine.from_probe takes it
            link="NVLink-C2C",
            peak_fp8_flops=1979 * _TFLOPS,
            source=_GH200_SOURCE,
            memory_source=_GH200_MEMORY,
            # the link figures are measured copies: no fraction of them is taken off
            assumptions=dataclasses.replace(_H100_EFFICIENCY, flops_source=_HOPPER_UNCALIBRATED, link_fraction=1.0),
        ),
        Machine(
            name="h100-nvl",
            device_type="cuda",
            peak_flops=835.5 * _TFLOPS,
            peak_fp8_flops=1670.5 * _TFLOPS,
            memory_gb_per_s=3900,
            memory_bytes=94 * 10**9,
            link_out_gb_per_s=64,
            link_back_gb_per_s=64,
            link_both_gb_per_s=128,
            link="PCIe Gen5 x16",
            interconnect_gb_per_s=64,
            interconnect="PCIe Gen5 x16 (its NVLink bridge joins pairs of GPUs only)",
            gpus_per_node=8,
            source=_H100_NVL_SOURCE,
            memory_source=_DATASHEET_MEMORY.format(gb=94),
            assumptions=dataclasses.replace(_H100_EFFICIENCY, flops_source=_HOPPER_UNCALIBRATED),
        ),
        Machine(
            name="l40s",
            device_type="cuda",
            peak_flops=362.05 * _TFLOPS,
            peak_fp8_flops=733 * _TFLOPS,
            memory_gb_per_s=864,
            memory_bytes=48 * 10**9,
            link_out_gb_per_s=32,
            link_back_gb_per_s=32,
            link_both_gb_per_s=64,
            link="PCIe Gen4 x16",
            interconnect_gb_per_s=32,
            interconnect="PCIe Gen4 x16 (no NVLink)",
            gpus_per_node=8,
            source=_L40S_SOURCE,
            memory_source=_DATASHEET_MEMORY.format(gb=48),
            assumptions=_UNCALIBRATED,
        ),
        Machine(
            name="mi300x",
            device_type="cuda",  # ROCm's torch calls it "cuda"
            peak_flops=1307.4 * _TFLOPS,
            peak_fp8_flops=2614.9 * _TFLOPS,
            memory_gb_per_s=5300,
            memory_bytes=192 * 10**9,
            link_out_gb_per_s=64,
            link_back_gb_per_s=64,
            link_both_gb_per_s=128,
            link="PCIe Gen5 x16",
            interconnect_gb_per_s=448,
            interconnect="Infinity Fabric, 7 links of 64 GB/s a direction, their sum (896 GB/s both ways)",
            gpus_per_node=8,
            source=_MI300X_SOURCE,
            memory_source=_DATASHEET_MEMORY.format(gb=192),
            assumptions=_UNCALIBRATED,
        ),
    )
}
"""The named machines, by ``Machine.name``. Read-only by convention: ``with_assumptions`` makes a changed copy."""


def machine_names() -> tuple[str, ...]:
    """The named machines ``offload.predict`` and ``offload.machine`` take, sorted (``offload.machines()``)."""
    return tuple(sorted(MACHINES))


def get_machine(name: str) -> Machine:
    """The named machine (``offload.machine(name)``), to pass to ``offload.predict`` as it is or with
    ``.with_assumptions(...)``; a ``ValueError`` lists the names where ``name`` is none of them."""
    if name not in MACHINES:
        raise ValueError(
            f"unknown machine {name!r}; named machines are: {', '.join(machine_names())} "
            "(or pass machine=offload.probe() for this one)"
        )
    return MACHINES[name]
