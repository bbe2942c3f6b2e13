"""Every torch name the CUDA path and its tests read exists in the torch at hand, checked on a CPU
build: a rename between torch versions (the GPU machine runs 2.11, development 2.13) fails here,
in CI, instead of in a GPU window.

- Attributes: every ``torch.cuda.*``, ``torch._C.*``, ``torch.accelerator.*``,
  ``torch.utils.deterministic.*`` and ``torch.backends.cud*.*`` name written out in offload/,
  tests/ and bench/ resolves.
- Keys: ``torch.cuda.host_memory_stats()`` is empty until CUDA is initialized, so the keys the
  tests read are checked against the caching host allocator's ``HostStats`` as this torch declares
  it (``include/ATen/core/CachingHostAllocator.h``, shipped in every wheel) and against the
  function's own docstring. On 2.11 and 2.13 its fields are active_requests, active_bytes,
  allocations, allocated_bytes and timings: there is no ``reserved_bytes``, which a test read
  with ``.get(..., 0)`` and so compared 0 with 0.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from test_cuda import PINNED_BYTES_KEY

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*REPO.glob("offload/**/*.py"), *REPO.glob("tests/*.py"), *REPO.glob("bench/*.py")])
NAME = re.compile(
    r"\btorch\.(?:cuda|_C|accelerator|utils\.deterministic|backends\.cuda|backends\.cudnn)(?:\.[A-Za-z_]\w*)+"
)
LOOKED_UP = {"torch._C._host_emptyCache", "torch.accelerator.empty_host_cache"}
"""Names the code looks up with ``getattr`` and a fallback: ``offload.seams.Host.return_pinned``
takes torch.accelerator's (from 2.13) or torch._C's (2.11; CPU builds of 2.13 lack it).
(``offload.seams.CudaStreams`` looks up ``_cuda_getCurrentStream`` of ``torch._C`` by its
name alone, so the scan does not see it: CPU builds lack it, and without it the class asks
``torch.cuda.current_stream``, which is checked here.)"""
CALLED_ON_TENSORS = ("torch.Tensor.record_stream", "torch.are_deterministic_algorithms_enabled", "torch._foreach_copy_")
"""Names the scan cannot see written out (a method called on a tensor, a top-level function:
``CudaStreams.copy_all``'s ``_foreach_copy_``)."""
HEADER = Path(torch.__file__).parent / "include" / "ATen" / "core" / "CachingHostAllocator.h"
STAT_HEADER = Path(torch.__file__).parent / "include" / "c10" / "core" / "Allocator.h"


def _resolves(name: str) -> bool:
    obj: object = torch
    for part in name.split(".")[1:]:
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            return False
    return True


def host_stats_fields(header: Path = HEADER) -> set[str]:
    """Names of the ``Stat`` fields of ``struct TORCH_API HostStats`` in ``header``."""
    body = re.search(r"struct TORCH_API HostStats \{(.*?)\n\};", header.read_text(), re.S)
    assert body is not None, f"no HostStats in {header}"
    return set(re.findall(r"^\s*Stat (\w+);", body.group(1), re.M))


def stat_members(header: Path = STAT_HEADER) -> set[str]:
    """The counters of one ``Stat`` (current, peak, ...), from ``struct Stat`` in ``header``."""
    body = re.search(r"struct Stat \{(.*?)\n\};", header.read_text(), re.S)
    assert body is not None, f"no Stat in {header}"
    return set(re.findall(r"^\s*int64_t (\w+) = 0;", body.group(1), re.M))


def test_every_cuda_name_written_out_resolves():
    names = sorted({m.group(0) for path in SOURCES for m in NAME.finditer(path.read_text())} | {*CALLED_ON_TENSORS})
    assert "torch.cuda.host_memory_stats" in names and "torch.cuda._sleep" in names, "the scan finds the code's names"
    missing = [name for name in names if name not in LOOKED_UP and not _resolves(name)]
    assert missing == [], f"not in torch {torch.__version__}: {missing}"


def test_the_host_cache_can_be_emptied():
    """The arena's way to give pinned pages back (``torch.accelerator.empty_host_cache`` from 2.13,
    ``torch._C._host_emptyCache`` before) exists."""
    accelerator = getattr(torch, "accelerator", None)
    assert callable(getattr(accelerator, "empty_host_cache", None)) or callable(
        getattr(torch._C, "_host_emptyCache", None)
    )


def test_the_pinned_bytes_key_is_a_host_stat():
    field, member = PINNED_BYTES_KEY.split(".")
    assert field in host_stats_fields(), f"{field} is not a HostStats field in torch {torch.__version__}"
    assert member in stat_members()
    doc = torch.cuda.host_memory_stats.__doc__ or ""
    assert f'"{field}.{{current,peak,allocated,freed}}"' in doc, "the documented keys agree"
    assert "reserved_bytes" not in host_stats_fields()
