"""The default training text, with nothing to download: Python's own standard library.

Every Python install carries a few megabytes of real, varied text: the ``*.py``
files at the top of its standard library directory. ``load_corpus`` reads them
at run time, in sorted file order, as raw bytes; each byte is a token, so the
vocabulary is 256 and no tokenizer is needed.

    stdlib/*.py (sorted) ──concat bytes──▶ uint8 tensor (N,) ──batches(seeded generator)──▶ (x, y) int64 (B, T)

Only the top level is read, never ``site-packages`` below it, so the text depends
on the Python version and not on what else is installed. Where there is no
standard library source (some embedded or stripped builds), the fallback is this
package's own source files.

``batches`` draws windows at offsets from a ``torch.Generator`` the caller seeds,
so the same seed gives the same batches, run after run.
"""

from __future__ import annotations

import logging
import pathlib
import sysconfig
from collections.abc import Iterator

import torch

__all__ = ["DEFAULT_MAX_BYTES", "batches", "load_corpus"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4_000_000
"""Default corpus size, bytes: a few seconds of CPU training never sees a window twice."""

MIN_CORPUS_BYTES = 32 * 1024
"""Smallest corpus worth training on, bytes: below this, batches repeat almost at once."""


def _stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _package_dir() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parents[1]


def _read_sources(paths: list[pathlib.Path], max_bytes: int) -> bytes:
    """Concatenate the files in ``paths``, in order, up to ``max_bytes``; unreadable files are skipped."""
    chunks: list[bytes] = []
    nbytes = 0
    for path in paths:
        if nbytes >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError as error:
            logger.debug("corpus: skipping %s (%s)", path, error)
            continue
        chunk = data[: max_bytes - nbytes]
        chunks.append(chunk)
        nbytes += len(chunk)
    return b"".join(chunks)


def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Byte-level training text as a 1-D ``uint8`` tensor of at most ``max_bytes`` tokens.

    Reads the standard library's top-level ``*.py`` files in sorted order; falls back to
    this package's own ``*.py`` files when the standard library source is missing or
    smaller than ``MIN_CORPUS_BYTES``. Raises ``RuntimeError`` if neither is large enough.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < MIN_CORPUS_BYTES:
        raise ValueError(
            f"load_corpus(max_bytes={max_bytes!r}): must be an int >= {MIN_CORPUS_BYTES}; "
            f"pass a larger limit (the default is {DEFAULT_MAX_BYTES})."
        )
    stdlib = _stdlib_dir()
    sources = [
        ("the standard library", stdlib, sorted(stdlib.glob("*.py")) if stdlib.is_dir() else []),
        ("the offload package", _package_dir(), sorted(_package_dir().rglob("*.py"))),
    ]
    for label, root, paths in sources:
        text = _read_sources(paths, max_bytes)
        if len(text) >= MIN_CORPUS_BYTES:
            logger.debug("corpus: %d bytes from %d files of %s (%s)", len(text), len(paths), label, root)
            return torch.frombuffer(bytearray(text), dtype=torch.uint8)
        logger.info("corpus: %s at %s has only %d bytes of *.py; trying the next source", label, root, len(text))
    raise RuntimeError(
        f"no training text found: neither the standard library ({stdlib}) nor the offload package "
        f"({_package_dir()}) holds {MIN_CORPUS_BYTES} bytes of *.py source. Install a Python with its "
        f"standard library source, or pass your own uint8 tensor of text to batches()."
    )


def batches(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(x, y)`` pairs of int64 token ids, each (batch_size, seq_len), with ``y`` = ``x`` shifted by one.

    Window offsets are drawn uniformly from ``generator``: seed it (``torch.Generator().manual_seed(s)``)
    for a reproducible stream. Tensors are on ``data``'s device; take a finite number with
    ``itertools.islice`` or ``zip(range(n), ...)``.
    """
    if data.dim() != 1 or data.is_floating_point():
        raise ValueError(
            f"batches(data=...) needs a 1-D integer tensor of token ids (as load_corpus returns), "
            f"got dtype {data.dtype} and shape {tuple(data.shape)}."
        )
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"batches({name}={value!r}): must be an int >= 1.")
    if data.numel() <= seq_len:
        raise ValueError(
            f"batches(seq_len={seq_len}) needs more than seq_len tokens, but data holds {data.numel()}; "
            f"use a shorter seq_len or a larger corpus."
        )
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"batches(generator=...) needs a torch.Generator, got {type(generator).__name__}.")
    return _windows(data, batch_size, seq_len, generator)


def _windows(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    window = torch.arange(seq_len + 1, device=data.device)
    num_offsets = data.numel() - seq_len
    while True:
        offsets = torch.randint(num_offsets, (batch_size, 1), generator=generator, device=generator.device)
        tokens = data[offsets.to(data.device) + window].long()  # (batch_size, seq_len + 1)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
