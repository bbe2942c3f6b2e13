"""The disk tier frees RAM: spilled bytes are not left in the page cache, and one file is reused.

Oracle: ``mincore`` over the spill directory (``offload._pagecache``) while a step runs. A buffered
write would leave every spilled page cached (measured before this tier was rebuilt: 98-100 % of the
bytes spilled per step); direct I/O leaves none, and the fallback (fdatasync + DONTNEED) almost none.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import offload
import offload._spill
from offload._pagecache import cached_bytes_under
from offload.models.gpt import GPTConfig, MiniGPT
from zoo import files_under, wait_clean

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and O_DIRECT are Linux's")

CACHED_SHARE_MAX = 0.05
"""Most of the spilled bytes allowed in the page cache at any reading (direct I/O measures 0 here;
a buffered write measured 1.0). The slack covers the fallback's pages between write and drop."""


def _real_disk(path) -> bool:
    return offload._spill._filesystem_type(path) not in ("tmpfs", "ramfs", "")


def _gpt():
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(n_layer=2, n_embd=128, n_head=4, seq_len=128))


def _step(model, eng, idx, readings):
    with eng:
        _, loss = model(idx, idx)
    readings.append((cached_bytes_under(eng_dir(eng)), eng.stats.spilled_bytes))
    loss.backward()


def eng_dir(eng) -> str:
    return eng.config.spill_dir


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered+dontneed"])
def test_spilled_bytes_leave_the_page_cache(direct, tmp_path, monkeypatch):
    if not _real_disk(tmp_path):
        pytest.skip(f"{tmp_path} is not on a disk (its pages are RAM whatever the engine does)")
    if not direct:
        monkeypatch.setattr(offload._spill, "_O_DIRECT", 0)
    model = _gpt()
    idx = torch.randint(0, 256, (4, 128))
    eng = offload.engine(0, spill_dir=tmp_path, model=model)
    readings = []
    for _ in range(3):
        _step(model, eng, idx, readings)
    stats = wait_clean(eng, tmp_path)
    assert stats.spilled_bytes > 0
    for cached, spilled in readings:
        assert spilled > 0 and cached <= CACHED_SHARE_MAX * spilled, (cached, spilled)
    assert cached_bytes_under(str(tmp_path)) <= CACHED_SHARE_MAX * stats.spilled_bytes, "reads leave no pages either"
    eng.close()


def test_one_spill_file_reused_across_steps(tmp_path):
    model = _gpt()
    idx = torch.randint(0, 256, (4, 128))
    eng = offload.engine(0, spill_dir=tmp_path, model=model)
    sizes = []
    for _ in range(4):
        with eng:
            _, loss = model(idx, idx)
        loss.backward()
        stats = wait_clean(eng, tmp_path)
        files = files_under(tmp_path)
        assert stats.spill_files == 1 and len(files) == 1, files
        assert oct(os.stat(files[0]).st_mode & 0o777) == oct(0o600)
        sizes.append(os.path.getsize(files[0]))
    assert stats.spilled_bytes > 0
    assert sizes[1:] == sizes[:1] * 3, f"extents are reused, the file does not grow: {sizes}"
    eng.close()
    assert list(tmp_path.iterdir()) == []
