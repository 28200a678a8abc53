"""trident/peak.py: the measured CPU peak is positive, probed once per machine and cached; an override wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trident import peak
from trident.peak import cpu_peak_tflops, device_peak_tflops, gpu_peak_bf16_tflops, probe_matmul_tflops


def test_probe_is_positive_and_finite() -> None:
    tflops = probe_matmul_tflops(torch.float32, threads=1, seconds=0.05)
    assert 0 < tflops < 1e4


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
