"""The machine probe: figures, the cache, argument checks and the ``python -m offload probe`` CLI.

Real measurements use small transfers (``SIZE_MB``); the cache tests replace the measuring
functions with counting fakes, so they check "measured or not" without timing anything. Those
fakes, the core counts and the probe's spill file stand in inside ``offload._memory.probe``
(white-box): what is checked is which measurement ran, which no public figure tells apart.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.__main__ import main
from offload._cost import MachineProfile
from offload._memory import probe as _probe
from offload._memory.probe import probe

SIZE_MB = 8
REPO_ROOT = Path(__file__).resolve().parents[1]
FAKE_LINK = (12.5, 11.0)
FAKE_DISK = (3.0, 6.0)
FAKE_OVERHEAD_US = 1.5


class _Calls(dict):
    spread = 0.0


@pytest.fixture
def calls(monkeypatch):
    """Replace the three measurements with fakes that count their calls; ``counts.spread`` is the
    spread of the readings each reports (0: they agreed)."""
    counts = _Calls(link=0, disk=0, overhead=0)

    def fake_link(device, nbytes, repeats):
        counts["link"] += 1
        return (*FAKE_LINK, counts.spread)

    def fake_disk(spill_dir, nbytes, repeats):
        counts["disk"] += 1
        return (*FAKE_DISK, True, counts.spread)

    def fake_overhead(device, spill_dir, repeats, out_gb_per_s, back_gb_per_s):
        counts["overhead"] += 1
        return FAKE_OVERHEAD_US, counts.spread

    monkeypatch.setattr(_probe, "_measure_link", fake_link)
    monkeypatch.setattr(_probe, "_measure_disk", fake_disk)
    monkeypatch.setattr(_probe, "_measure_per_tensor_overhead_us", fake_overhead)
    return counts


def test_cpu_probe_measures_disk_and_has_no_link(tmp_path, monkeypatch):
    """On the CPU the tier behind the device is the disk: no link is measured, and the per-tensor
    overhead is what moving tensors through the spill file costs beyond the disk's byte time."""
    spill = tmp_path / "spill"
    spill.mkdir()
    seen = []
    real = _probe._measure_per_tensor_overhead_us

    def overhead(device, spill_dir, repeats, out_gb_per_s, back_gb_per_s):
        us, spread = real(device, spill_dir, repeats, out_gb_per_s, back_gb_per_s)
        seen.append((out_gb_per_s, back_gb_per_s, us))
        return us, spread

    monkeypatch.setattr(_probe, "_measure_per_tensor_overhead_us", overhead)
    profile = probe("cpu", spill_dir=spill, cache_path=tmp_path / "probe.json", size_mb=SIZE_MB, repeats=1)
    assert isinstance(profile, MachineProfile)
    assert profile.device_type == "cpu" and profile.device_name
    assert profile.disk_write_gb_per_s > 0 and profile.disk_read_gb_per_s > 0
    assert profile.d2h_gb_per_s == 0.0 and profile.h2d_gb_per_s == 0.0
    assert seen == [(profile.disk_write_gb_per_s, profile.disk_read_gb_per_s, profile.per_tensor_overhead_us)], (
        "measured once, charging the disk's byte time, and reported as measured"
    )
    assert math.isfinite(profile.per_tensor_overhead_us)
    assert profile.offload_gb_per_s() == (profile.disk_write_gb_per_s, profile.disk_read_gb_per_s)
    assert list(spill.iterdir()) == [], "the probe file must be removed"


def test_cache_is_written_and_reused(tmp_path, calls):
    cache = tmp_path / "probe.json"
    first = probe("cpu", spill_dir=tmp_path, cache_path=cache)
    assert calls == {"link": 0, "disk": 1, "overhead": 1}
    assert cache.is_file()
    assert (first.disk_write_gb_per_s, first.disk_read_gb_per_s) == FAKE_DISK
    assert first.per_tensor_overhead_us == FAKE_OVERHEAD_US

    second = probe("cpu", spill_dir=tmp_path, cache_path=cache)
    assert calls == {"link": 0, "disk": 1, "overhead": 1}, "a cached probe must not measure again"
    assert second == first


def test_new_spill_dir_measures_the_disk_and_the_moves_through_it(tmp_path, calls):
    # On the CPU a moved tensor goes through the spill directory, so its per-tensor cost is
    # measured again with the disk; the link (CUDA only) is not measured at all.
    cache = tmp_path / "probe.json"
    other = tmp_path / "other"
    other.mkdir()
    probe("cpu", spill_dir=tmp_path, cache_path=cache)
    probe("cpu", spill_dir=other, cache_path=cache)
    assert calls == {"link": 0, "disk": 2, "overhead": 2}
    probe("cpu", spill_dir=tmp_path, cache_path=cache)  # both spill dirs are cached now
    assert calls == {"link": 0, "disk": 2, "overhead": 2}


def test_thread_count_is_part_of_the_key(tmp_path, calls):
    cache = tmp_path / "probe.json"
    threads = torch.get_num_threads()
    try:
        probe("cpu", spill_dir=tmp_path, cache_path=cache)
        torch.set_num_threads(threads + 1)
        probe("cpu", spill_dir=tmp_path, cache_path=cache)
    finally:
        torch.set_num_threads(threads)
    assert calls == {"link": 0, "disk": 1, "overhead": 2}


def test_refresh_measures_again(tmp_path, calls):
    cache = tmp_path / "probe.json"
    probe("cpu", spill_dir=tmp_path, cache_path=cache)
    probe("cpu", spill_dir=tmp_path, cache_path=cache, refresh=True)
    assert calls == {"link": 0, "disk": 2, "overhead": 2}


def test_cache_path_defaults_to_xdg_cache_home(tmp_path, monkeypatch, calls):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    probe("cpu", spill_dir=tmp_path)
    assert (tmp_path / "xdg" / "offload" / "probe.json").is_file()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2, 3]",
        '{"format": 999}',
        '{"format": 2, "link": [], "disk": {}}',
        b"\xff\xfe\x00garbage",
    ],
    ids=["syntax", "not-a-dict", "other-format", "bad-section", "not-utf8"],
)
def test_corrupt_cache_is_ignored_with_a_warning(tmp_path, calls, caplog, content):
    cache = tmp_path / "probe.json"
    if isinstance(content, bytes):
        cache.write_bytes(content)
    else:
        cache.write_text(content)
    with caplog.at_level(logging.WARNING, logger=_probe.__name__):
        profile = probe("cpu", spill_dir=tmp_path, cache_path=cache)
    assert (profile.disk_write_gb_per_s, profile.disk_read_gb_per_s) == FAKE_DISK
    assert calls["disk"] == 1
    assert any("cache" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert json.loads(cache.read_text())["format"] == _probe._CACHE_FORMAT, "the corrupt file is replaced by a good one"


def test_cached_entry_with_bad_figures_is_measured_again(tmp_path, calls, caplog):
    cache = tmp_path / "probe.json"
    probe("cpu", spill_dir=tmp_path, cache_path=cache)
    data = json.loads(cache.read_text())
    for entry in data["disk"].values():
        entry["disk_write_gb_per_s"] = "fast"
    cache.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger=_probe.__name__):
        probe("cpu", spill_dir=tmp_path, cache_path=cache)
    assert calls == {"link": 0, "disk": 2, "overhead": 1}
    assert any("disk_write_gb_per_s" in r.getMessage() for r in caplog.records)


def test_unwritable_cache_only_warns(tmp_path, calls, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger=_probe.__name__):
        profile = probe("cpu", spill_dir=tmp_path, cache_path=blocker / "probe.json")
    assert profile.disk_write_gb_per_s == FAKE_DISK[0]
    assert any("could not write cache" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"size_mb": 0}, "size_mb=0"),
        ({"size_mb": -3}, "size_mb=-3"),
        ({"size_mb": 1.5}, "size_mb=1.5"),
        ({"repeats": 0}, "repeats=0"),
        ({"device": "meta"}, "device='meta'"),
        ({"device": "not-a-device"}, "device='not-a-device'"),
        ({"spill_dir": "/nonexistent/offload-probe"}, "spill_dir='/nonexistent/offload-probe'"),
    ],
)
def test_bad_arguments_raise_value_error(tmp_path, calls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        probe(cache_path=tmp_path / "probe.json", **kwargs)
    assert calls == {"link": 0, "disk": 0, "overhead": 0}


def test_spill_dir_that_is_a_file_is_rejected(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ValueError, match="not an existing directory"):
        probe("cpu", spill_dir=path, cache_path=tmp_path / "probe.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is missing")
def test_cuda_without_cuda_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="device='cuda'.*device='cpu'"):
        probe("cuda", cache_path=tmp_path / "probe.json")


def test_spare_cores_follow_torchs_threads_not_the_cache(tmp_path, calls, monkeypatch):
    """Cores beyond torch's intra-op threads are the spill threads' own: read at each call, from the
    process's affinity, so a cached entry never carries a thread count that has since changed."""
    monkeypatch.setattr(_probe, "usable_cores", lambda: 4)
    threads = torch.get_num_threads()
    seen = {}
    try:
        for n in (1, 3, 4, 6):
            torch.set_num_threads(n)
            seen[n] = probe("cpu", spill_dir=tmp_path, cache_path=tmp_path / "probe.json").spare_cores
            seen[n, "cached"] = probe("cpu", spill_dir=tmp_path, cache_path=tmp_path / "probe.json").spare_cores
    finally:
        torch.set_num_threads(threads)
    assert seen == {1: 3, (1, "cached"): 3, 3: 1, (3, "cached"): 1, 4: 0, (4, "cached"): 0, 6: 0, (6, "cached"): 0}


def _cgroup(tmp_path, proc_lines: list[str], files: dict[str, str]):
    """A fake /proc/self/cgroup and cgroup tree under tmp_path."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text("\n".join(proc_lines) + "\n")
    root = tmp_path / "fs"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


def test_a_cgroup_cpu_quota_caps_the_usable_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(_probe.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(_probe.psutil, "cpu_count", lambda logical=True: 64)
    v2 = _cgroup(
        tmp_path / "v2", ["0::/pod/job"], {"pod/cpu.max": "250000 100000\n", "pod/job/cpu.max": "max 100000\n"}
    )
    assert _probe.cpu_quota(*v2) == 2.5 and _probe.usable_cores(*v2) == 3
    v1 = _cgroup(
        tmp_path / "v1",
        ["4:memory:/x", "3:cpu,cpuacct:/job"],
        {"cpu,cpuacct/job/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"},
    )
    assert _probe.cpu_quota(*v1) == 2.0 and _probe.usable_cores(*v1) == 2
    unlimited = _cgroup(tmp_path / "none", ["0::/"], {"cpu.max": "max 100000\n"})
    assert _probe.cpu_quota(*unlimited) is None and _probe.usable_cores(*unlimited) == 64
    assert _probe.cpu_quota(tmp_path / "missing", tmp_path) is None


def test_hardware_threads_are_not_spare_cores(tmp_path, monkeypatch):
    """torch's default thread count is the physical cores; a core's second hardware thread is no
    free core for the spill threads."""
    monkeypatch.setattr(_probe.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(_probe.psutil, "cpu_count", lambda logical=True: 16 if logical else 8)
    no_cgroup = (tmp_path / "missing", tmp_path)
    assert _probe.usable_cores(*no_cgroup) == 8
    monkeypatch.setattr(_probe, "usable_cores", lambda: 8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(8)
        assert _probe.spare_cores() == 0
        torch.set_num_threads(6)
        assert _probe.spare_cores() == 2
    finally:
        torch.set_num_threads(threads)


def test_the_usable_cores_are_part_of_the_key(tmp_path, calls, monkeypatch):
    cache = tmp_path / "probe.json"
    for cores in (2, 4, 2):
        monkeypatch.setattr(_probe, "usable_cores", lambda cores=cores: cores)
        probe("cpu", spill_dir=tmp_path, cache_path=cache)
    assert calls == {"link": 0, "disk": 1, "overhead": 2}


def test_cli_prints_a_table(tmp_path, monkeypatch, calls):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["probe", "--device", "cpu", "--spill-dir", str(tmp_path)])
    assert code == 0
    text = out.getvalue()
    assert "disk write" in text and "3.00 GB/s" in text and "6.00 GB/s" in text
    assert "n/a" in text  # no device link on the CPU
    assert re.search(rf"spare cores\s+{_probe.spare_cores()}\s", text)


def test_cli_json(tmp_path, monkeypatch, calls):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["probe", "--device", "cpu", "--spill-dir", str(tmp_path), "--json"])
    assert code == 0
    data = json.loads(out.getvalue())
    assert MachineProfile(**data) == probe("cpu", spill_dir=tmp_path)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nope"],
        ["probe", "--size-mb", "x"],
        ["probe", "--size-mb", "0"],
        ["probe", "--spill-dir", "/nonexistent/x"],
    ],
)
def test_cli_bad_input_exits_2_with_a_message(tmp_path, monkeypatch, calls, capsys, argv):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


def _subprocess_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slow  # a subprocess that probes
def test_cli_subprocess_json(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "offload", "probe", "--json", "--size-mb", str(SIZE_MB), "--repeats", "1"],
        capture_output=True,
        text=True,
        env=_subprocess_env(tmp_path),
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    profile = MachineProfile(**json.loads(result.stdout))
    assert profile.disk_write_gb_per_s > 0 and profile.disk_read_gb_per_s > 0
    assert (tmp_path / "cache" / "offload" / "probe.json").is_file()


def test_import_does_not_initialize_cuda(tmp_path):
    code = "import torch, offload._memory.probe, offload.__main__; assert not torch.cuda.is_initialized()"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_subprocess_env(tmp_path), timeout=120
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_probe_measures_both_link_directions(tmp_path):
    profile = probe("cuda", spill_dir=tmp_path, cache_path=tmp_path / "probe.json", size_mb=SIZE_MB, repeats=3)
    assert profile.device_type == "cuda" and profile.device_name
    assert profile.d2h_gb_per_s > 0 and profile.h2d_gb_per_s > 0
    assert profile.offload_gb_per_s() == (profile.d2h_gb_per_s, profile.h2d_gb_per_s)
    assert profile.disk_write_gb_per_s > 0 and profile.disk_read_gb_per_s > 0


def test_cli_says_whether_figures_are_measured_now_or_cached_and_when(tmp_path, monkeypatch, calls):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ["probe", "--device", "cpu", "--spill-dir", str(tmp_path)]

    def run(*extra):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([*argv, *extra]) == 0
        return out.getvalue()

    first = run()
    stamps = re.findall(r"measured now \((\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4})\)", first)
    assert len(stamps) == 2, first  # link and disk, both measured on this call
    second = run()
    assert "measured now" not in second
    assert f"cached, measured {stamps[0]} (--refresh measures again)" in second
    assert calls == {"link": 0, "disk": 1, "overhead": 1}
    assert "measured now" in run("--refresh")


@pytest.mark.parametrize(
    "direct, label", [(True, "direct I/O, as the spill tier does it"), (False, "buffered, pages dropped")]
)
def test_cli_disk_rows_name_the_spill_files_io(tmp_path, monkeypatch, calls, direct, label):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(_probe, "_measure_disk", lambda spill_dir, nbytes, repeats: (*FAKE_DISK, direct, 0.0))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["probe", "--device", "cpu", "--spill-dir", str(tmp_path)]) == 0
    text = out.getvalue()
    assert f"3.00 GB/s  (spill file, {label})" in text and f"6.00 GB/s  (spill file, {label})" in text
    assert "page cache" not in text and "no fsync" not in text


def test_cli_json_keeps_stdout_one_object_and_says_where_on_stderr(tmp_path, monkeypatch, calls, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["probe", "--device", "cpu", "--spill-dir", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    assert MachineProfile(**json.loads(captured.out)).disk_write_gb_per_s == FAKE_DISK[0]
    assert "offload probe: disk: measured now (" in captured.err


def test_cached_disk_figures_that_do_not_say_their_io_are_measured_again(tmp_path, calls):
    """An entry from before the probe measured through the spill file may hold buffered figures."""
    cache = tmp_path / "probe.json"
    probe("cpu", spill_dir=tmp_path, cache_path=cache, size_mb=SIZE_MB)
    data = json.loads(cache.read_text())
    for entry in data["disk"].values():
        assert entry["disk_io"] == "direct"
        del entry["disk_io"]
    cache.write_text(json.dumps(data))
    report = _probe.probe_report("cpu", spill_dir=tmp_path, cache_path=cache, size_mb=SIZE_MB)
    assert calls == {"link": 0, "disk": 2, "overhead": 1}
    assert report.disk.source is _probe.Source.MEASURED and report.link.source is _probe.Source.CACHED


def test_the_disk_is_measured_through_the_spill_tiers_own_file(tmp_path, monkeypatch):
    """Not buffered writes: the probe writes and reads a ``SpillFile``, as the disk tier does, and
    reports whether its I/O was direct."""
    from offload._memory.spill import SpillFile

    closed_with = []

    class Spy(SpillFile):
        def close(self):
            closed_with.append(self.direct)  # None: nothing was ever written through it
            super().close()

    monkeypatch.setattr(_probe, "SpillFile", Spy)
    write, read, direct, _ = _probe._measure_disk(str(tmp_path), 1 << 20, 1)
    assert write > 0 and read > 0
    assert closed_with == [direct] and isinstance(direct, bool)


def test_figures_whose_readings_spread_wide_are_used_but_not_cached(tmp_path, calls):
    """One disturbed reading must not be planned with by every engine after it: a section whose
    readings spread wider than MAX_SPREAD is measured again by the next call, and says so."""
    from offload._memory.probe import probe_report
    from offload._plan.noise import MAX_SPREAD

    cache = tmp_path / "probe.json"
    calls.spread = MAX_SPREAD * 2
    report = probe_report("cpu", spill_dir=tmp_path, cache_path=cache)
    assert report.profile.per_tensor_overhead_us == FAKE_OVERHEAD_US, "the median is used now"
    assert not report.disk.kept and not report.link.kept
    assert "not cached" in report.disk.describe() and f"{MAX_SPREAD * 2:.0%}" in report.disk.describe()
    probe_report("cpu", spill_dir=tmp_path, cache_path=cache)
    assert (calls["disk"], calls["overhead"]) == (2, 2), "measured again: nothing was cached"
    calls.spread = MAX_SPREAD / 2
    probe_report("cpu", spill_dir=tmp_path, cache_path=cache)
    probe_report("cpu", spill_dir=tmp_path, cache_path=cache)
    assert (calls["disk"], calls["overhead"]) == (3, 3), "readings that agree are cached"


def test_readings_median_and_spread():
    from offload._plan.noise import Readings

    steady = Readings([4.1, 4.3, 4.4, 4.6, 9.8])
    assert steady.median == 4.4 and steady.steady()
    noisy = Readings([0.4, 1.7, 2.2, 4.1, 20.0])
    assert noisy.median == 2.2 and not noisy.steady()
    assert Readings([3.0]).spread == 0.0
    with pytest.raises(ValueError):
        Readings([])
