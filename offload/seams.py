"""The engine's seams: where it meets the machine, each replaceable by a stand-in.

A test, a simulation or a benchmark passes its own, bundled in one ``Seams``, as
``offload.engine(..., seams=offload.Seams(...))``, and sees exactly the engine's traffic there,
without patching offload's internals. A user's training loop passes none: each seam left out is
this machine's.

| seam | passed as | default |
|---|---|---|
| ``Link`` | ``Seams(link=...)``: device-host copies | ``CudaLink`` (side streams) on CUDA; none on the CPU |
| ``Streams`` | ``CudaLink(device, streams=...)`` | ``CudaStreams``: torch.cuda streams and events |
| ``Host`` | ``Seams(host=...)``: host memory, the spill file | this machine (torch, psutil, ``os``) |
| ``Jobs`` | ``Host.jobs``: where the spill file's I/O runs | ``WorkerThreads`` |
| ``FreeMemory`` | ``Seams(memory=...)``: free device memory (``budget_mb="auto"``) | the CUDA allocator, or psutil |

What plans are priced on is not a seam but a setting: ``offload.engine(machine=...)`` takes a named
GPU (``offload.machine("h100-sxm")``, datasheet figures) or a measured ``MachineProfile``
(``offload.probe()``, or one a test writes by hand); None measures this machine.

Which wins, one rule: a seam given in ``Seams`` is the one used, and it replaces whatever another
seam would have brought: ``Seams(host=...)`` replaces the host a link carries (an emulator's). The
engine's old keywords (``link=``, ``host=``, ``memory=``) still fill the same fields for one release,
with a ``DeprecationWarning``; naming one seam both ways is an error.

Each class's docstring is its contract; a stand-in keeps it. ``PinnedSlabs`` lets engines made
one after another (a benchmark's configurations) share pinned host memory through their
``CudaLink``. ``Pending`` is what a link's copies return.

A spill disk that is full, for example:

```python
import errno, os
import offload
from offload.seams import Host

class FullDisk(Host):
    def pwrite(self, fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

eng = offload.engine(0, seams=offload.Seams(host=FullDisk()))  # tensors stay in memory, with one warning
```
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

from ._budget import FreeMemory
from ._cost import MachineProfile
from ._memory.arena import PinnedSlabs
from ._memory.host import Host, Jobs, WorkerThreads
from ._memory.pending import Pending
from ._memory.transfer import CudaLink, CudaStreams, Link, Streams

__all__ = [
    "CudaLink",
    "CudaStreams",
    "FreeMemory",
    "Host",
    "Jobs",
    "Link",
    "MachineProfile",
    "Pending",
    "PinnedSlabs",
    "Seams",
    "Streams",
    "WorkerThreads",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Seams:
    """The stand-ins one engine uses where it meets the machine (``offload.engine(seams=...)``).

    Every field left None is this machine's own. See the module docstring for which wins.
    """

    link: Optional[Link] = None
    """The transport between the device and host memory. None: CUDA side streams on a CUDA device;
    on the CPU none, and tensors go to disk. A test passes its own to run the host tier on the CPU."""
    host: Optional[Host] = None
    """Host memory for the host tier, and the spill file's filesystem calls and I/O threads. None:
    this machine, or the host the link carries (an emulator's). Given, it replaces the link's."""
    memory: Union[FreeMemory, Callable[[], int], None] = None
    """With ``budget_mb="auto"``: how free device memory is read, a callable returning free bytes or
    a ``FreeMemory`` with its own re-read rule. None: the device's own reading."""

    def __post_init__(self) -> None:
        if self.host is not None and not isinstance(self.host, Host):
            raise TypeError(
                f"Seams(host=...) must be an offload.seams.Host (or a subclass), got {type(self.host).__name__}"
            )
        object.__setattr__(self, "memory", FreeMemory.from_user(self.memory))

    def __repr__(self) -> str:
        given = [
            f"{f.name}={type(getattr(self, f.name)).__name__}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        ]
        return f"Seams({', '.join(given)})"
