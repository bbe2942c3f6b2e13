"""The engine's seams: where it meets the machine, each replaceable by a stand-in.

A test, a simulation or a benchmark passes its own to ``offload.engine`` and sees exactly the
engine's traffic there, without patching offload's internals.

| seam | passed as | default |
|---|---|---|
| ``Link`` | ``offload.engine(link=...)``: device-host copies | ``CudaLink`` (side streams) on CUDA; none on the CPU |
| ``Streams`` | ``CudaLink(device, streams=...)`` | ``CudaStreams``: torch.cuda streams and events |
| ``Host`` | ``offload.engine(host=...)``: host memory, the spill file | this machine (torch, psutil, ``os``) |
| ``Jobs`` | ``Host.jobs``: where the spill file's I/O runs | ``WorkerThreads`` |
| ``FreeMemory`` | ``offload.engine(memory=...)``: free device memory | the CUDA allocator and driver, or psutil |
| ``MachineProfile`` | ``offload.engine(machine=...)``: what plans are priced on | ``offload.probe()`` of this machine |

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

eng = offload.engine(0, host=FullDisk())  # tensors stay in memory, with one warning
```
"""

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
    "Streams",
    "WorkerThreads",
]
