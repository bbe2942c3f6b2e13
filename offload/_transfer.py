"""Copies between the CUDA device and pinned host memory, on a side stream.

Owns the side stream of one device and the event discipline around it; nothing else in the
package touches CUDA streams. Importing this module does not initialize CUDA: the stream is made
on first use.

    compute stream: ──fwd k──┬──fwd k+1──────────────── ... ──bwd k+1──wait(ev_h2d)──bwd k──
    side stream:             └wait──d2h k──ev_d2h            └wait──h2d k──ev_h2d

Note: [keep-alive until the copy event]
    The source of a copy in flight (a device tensor for d2h, a pinned buffer for h2d) is kept by
    reference until the copy's event has completed; only then may the caching allocator (or the
    pool) hand its memory to someone else. We do this instead of ``Tensor.record_stream`` so the
    engine's byte accounting stays exact: the bytes count as resident until the event says done.

Note: [reload destination on the compute stream]
    A reload destination is allocated while the compute stream is current, so the allocator ties
    the block to the stream that will use and free it. The side stream first waits for the compute
    stream (the block may have been used there before), writes it, and the compute stream waits on
    the copy's event at the point of use, never earlier.
"""

from __future__ import annotations

import torch

__all__ = ["CudaLink", "is_done", "is_event", "wait"]


class CudaLink:
    """The side stream of one CUDA device and the two copy directions over it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = None

    def _side(self) -> "torch.cuda.Stream":
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def d2h(self, src_device: torch.Tensor, dst_host: torch.Tensor) -> "torch.cuda.Event":
        """Start copying ``src_device`` (uint8) into the front of pinned ``dst_host``; returns its event.

        The copy is ordered after everything already queued on the stream current now (the producer).
        See Note: [keep-alive until the copy event]: the caller keeps ``src_device`` until the event is done.
        """
        side = self._side()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            dst_host[: src_device.numel()].copy_(src_device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event

    def h2d(self, src_host: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, "torch.cuda.Event"]:
        """Start copying ``nbytes`` of pinned ``src_host`` to a new device tensor; returns (tensor, event).

        See Note: [reload destination on the compute stream].
        """
        compute = torch.cuda.current_stream(self.device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        side = self._side()
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            dst.copy_(src_host[:nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return dst, event

    def wait_on_compute(self, event: "torch.cuda.Event") -> None:
        """Make the stream current now wait for ``event`` (GPU-side; the host does not block)."""
        torch.cuda.current_stream(self.device).wait_event(event)


def is_event(waitable) -> bool:
    """True for a stream event (``query``/``synchronize``), False for a future (``done``/``result``)."""
    return hasattr(waitable, "query")


def is_done(waitable) -> bool:
    """True when a stream event or a future has completed (never blocks)."""
    return waitable.query() if is_event(waitable) else waitable.done()


def wait(waitable) -> None:
    """Block the host until a stream event or a future has completed (a future's error is raised)."""
    if is_event(waitable):
        waitable.synchronize()
    else:
        waitable.result()
