"""trident/peak.py: the measured CPU peak is positive, probed once per machine and cached; an override wins; the GPU
table matches device names by whole words."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trident import peak
from trident.peak import cpu_peak_tflops, device_peak_tflops, gpu_peak_bf16_tflops, probe_matmul_tflops


def test_probe_is_positive_and_finite() -> None:
    tflops = probe_matmul_tflops(torch.float32, threads=1, seconds=0.05)
    assert 0 < tflops < 1e4


@pytest.mark.multiprocess
def test_a_busy_machine_does_not_lower_the_one_thread_peak() -> None:
    """Three busy loops per core leave a matmul on every core a quarter of the wall clock: timed by the wall on the
    threads of a one-process run, the peak would come out below the idle one and be cached so, and every later run's
    MFU would pass 1. Timed by one thread's CPU time it is the same peak, less what sharing a core's caches (or its
    hyperthread sibling) with the loops costs: 0.70 of the idle figure in one CI run beside the other xdist worker,
    so the bound sits halfway between a quarter (the wall clock's figure) and one."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * (os.cpu_count() or 1))]
    try:
        busy = probe_matmul_tflops(torch.float32, threads=os.cpu_count() or 1, seconds=0.5)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    alone = probe_matmul_tflops(torch.float32, threads=os.cpu_count() or 1, seconds=0.5)
    assert busy > 0.5 * alone, (busy, alone)


def test_probe_is_cached_per_machine_threads_and_precision(tmp_path: Path) -> None:
    """The first call probes and writes its figure under a key naming the CPU, the threads and the precision;
    the next call reads that entry back instead of probing (a planted value comes back as is)."""
    cache = tmp_path / "cache" / "peak.json"
    first = cpu_peak_tflops("fp32", 1, cache)
    assert first > 0
    (key, value), *others = json.loads(cache.read_text()).items()
    assert not others and value == first
    assert peak.cpu_model() in key and "1 threads" in key and "fp32" in key

    cache.write_text(json.dumps({key: 123.0}))
    assert cpu_peak_tflops("fp32", 1, cache) == 123.0
    # Another thread count is another entry, probed and added beside the first.
    assert cpu_peak_tflops("fp32", 2, cache) != 123.0
    assert len(json.loads(cache.read_text())) == 2


def test_damaged_cache_is_probed_again(tmp_path: Path) -> None:
    cache = tmp_path / "peak.json"
    cache.write_text("{not json")
    assert cpu_peak_tflops("fp32", 1, cache) > 0
    assert len(json.loads(cache.read_text())) == 1


def test_override_wins_and_probes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit logging.peak_tflops is used as is, on CPU (no probe, no cache file) and on a known GPU."""
    cache = tmp_path / "peak.json"
    assert device_peak_tflops(torch.device("cpu"), "bf16", 42.0, threads=1, cache=cache) == 42.0
    assert not cache.exists()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: "NVIDIA H100 80GB HBM3")
    assert device_peak_tflops(torch.device("cuda", 0), "bf16", 42.0) == 42.0


def test_cpu_peak_is_the_cached_probe(tmp_path: Path) -> None:
    cache = tmp_path / "peak.json"
    measured = device_peak_tflops(torch.device("cpu"), "fp32", None, threads=1, cache=cache)
    assert measured == cpu_peak_tflops("fp32", 1, cache) > 0


def test_gpu_peak_is_the_datasheet_figure_for_the_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16/fp16 use the table's dense peak, fp32 the TF32 peak (half); an unknown GPU gives None."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: "NVIDIA A100-SXM4-80GB")
    assert device_peak_tflops(cuda, "bf16", None) == 312.0
    assert device_peak_tflops(cuda, "fp32", None) == 156.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: "NVIDIA RTX PRO 9999")
    assert device_peak_tflops(cuda, "bf16", None) is None
    assert gpu_peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0


# Names as torch.cuda.get_device_name() reports them on real machines, with the peak each must get.
# Several are chosen because a plain substring test gets them wrong: "L40" contains "L4",
# "A100" contains "A10", "GH200" contains "H200", "H100 PCIe" starts with "H100".
GPU_NAMES = [
    ("NVIDIA L40", 181.0),
    ("NVIDIA L4", 121.0),
    ("NVIDIA L40S", 362.0),
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A10", 125.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA GH200 480GB", 989.0),
    ("Tesla V100-SXM2-16GB", 125.0),
    ("AMD Instinct MI300X", 1307.0),
]


@pytest.mark.parametrize(("name", "tflops"), GPU_NAMES, ids=[name for name, _ in GPU_NAMES])
def test_gpu_peak_matches_whole_words(name: str, tflops: float) -> None:
    """Each real device name maps to its own table entry, not to a shorter key it happens to contain."""
    assert gpu_peak_bf16_tflops(name) == tflops


def test_gpu_peak_unknown_is_none() -> None:
    """A GPU missing from the table gives None (MFU logged as null), not a guess."""
    assert gpu_peak_bf16_tflops("NVIDIA RTX PRO 9999") is None
    # A Quadro T400 is not a T4: only whole-word matching keeps "T4" from claiming it.
    assert gpu_peak_bf16_tflops("NVIDIA T400 4GB") is None


# One-word keys that are prefixes or suffixes of one another. The table lists the longer key first, which alone
# would hide a prefix match; trying both orders shows the whole-word rule itself tells them apart.
ONE_WORD_KEYS = [
    ("NVIDIA L40", "L40"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H20", "H20"),
]


@pytest.mark.parametrize("order", ["table", "reversed"])
@pytest.mark.parametrize(("name", "key"), ONE_WORD_KEYS, ids=[name for name, _ in ONE_WORD_KEYS])
def test_gpu_peak_whole_words_in_any_order(monkeypatch: pytest.MonkeyPatch, name: str, key: str, order: str) -> None:
    """Each one-word name finds its own key with the table in either order. The peaks are replaced by each
    key's position, so a neighbour with the same peak (H200 for GH200) cannot pass for it."""
    keys = list(peak.GPU_PEAK_BF16_TFLOPS)
    if order == "reversed":
        keys.reverse()
    monkeypatch.setattr(peak, "GPU_PEAK_BF16_TFLOPS", {k: float(i) for i, k in enumerate(keys)})
    assert gpu_peak_bf16_tflops(name) == float(keys.index(key))


def test_ranks_oversubscribing_the_cores_share_the_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "peak.json"
    alone = device_peak_tflops(torch.device("cpu"), "fp32", None, threads=1, cache=cache)
    cores = os.cpu_count() or 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))  # four one-thread ranks per core
    assert device_peak_tflops(torch.device("cpu"), "fp32", None, threads=1, cache=cache) == pytest.approx(alone / 4)
