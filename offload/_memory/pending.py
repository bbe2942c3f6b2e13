"""Work that finishes later, behind one small protocol the store waits on.

A copy on a CUDA side stream finishes when its event does; a spill write or read finishes when its
worker thread does. The store does not care which: it asks ``done()`` (never blocks), ``wait()``
(blocks the host; raises the ``OSError`` of a failed write or read), ``error()`` (after ``done()``),
and ``order_compute()``: make the compute stream wait for it, on the device where the device can
(a stream waits on an event without the host blocking), on the host otherwise.

``blocks_host`` says which of the two ``order_compute`` does, so the store times host waits itself
and leaves device stalls to the link that can see them.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Optional, Protocol

__all__ = ["FINISHED", "AllOf", "FromFuture", "Pending", "failed"]


class Pending(Protocol):
    """Something in flight: a copy on a stream, a write or read on a thread."""

    blocks_host: bool

    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def error(self) -> Optional[BaseException]: ...

    def order_compute(self) -> None: ...


class _Finished:
    """Already complete; what a copy that needs no waiting holds."""

    blocks_host = False

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def error(self) -> Optional[BaseException]:
        return None

    def order_compute(self) -> None:
        return None

    def __repr__(self) -> str:
        return "FINISHED"


FINISHED = _Finished()


class FromFuture:
    """A worker thread's result: done when the future is; its ``OSError`` raised by ``wait``."""

    __slots__ = ("future",)
    blocks_host = True

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()

    def error(self) -> Optional[BaseException]:
        return self.future.exception() if self.future.done() else None

    def order_compute(self) -> None:
        self.wait()


def failed(error: BaseException) -> FromFuture:
    """A pending that has already failed with ``error``."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(error)
    return FromFuture(future)


class AllOf:
    """Several pendings seen as one (done when all are; errors are the parts' business)."""

    __slots__ = ("parts",)
    blocks_host = True

    def __init__(self, parts: Sequence[Pending]) -> None:
        self.parts = [p for p in parts if p is not FINISHED]

    def done(self) -> bool:
        return all(p.done() for p in self.parts)

    def wait(self) -> None:
        for p in self.parts:
            try:
                p.wait()
            except OSError:
                pass  # a failed write or read is reported where it is landed, not here

    def error(self) -> Optional[BaseException]:
        return None

    def order_compute(self) -> None:
        self.wait()
