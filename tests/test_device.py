"""trident/device.py: which device each rank drives and which backend follows from it, on faked GPU counts."""

from __future__ import annotations

import re

import pytest
import torch

from trident.device import pick_backend, pick_device, set_cpu_threads
from trident.errors import ConfigError


def fake_node(
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    cuda_visible_devices: str | None = None,
) -> None:
    """Pretend this process sees `gpus` GPUs and was launched with the given env; None unsets a variable.

    Every variable is set or removed, so the real environment of the test runner cannot leak in.
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    env = {"LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world_size, "CUDA_VISIBLE_DEVICES": cuda_visible_devices}
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))


def test_no_gpu_auto_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU, auto falls back to the CPU."""
    fake_node(monkeypatch, gpus=0)
    assert pick_device("auto") == torch.device("cpu")


def test_no_gpu_cuda_requested_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU, an explicit cuda request is a config error, not a silent CPU run."""
    fake_node(monkeypatch, gpus=0)
    with pytest.raises(ConfigError, match="no GPU"):
        pick_device("cuda")


def test_cpu_requested_on_gpu_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit cpu request is honoured even when GPUs are there (and even with too many ranks for them)."""
    fake_node(monkeypatch, gpus=8, local_rank=3, local_world_size=16)
    assert pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_one_gpu_per_rank(monkeypatch: pytest.MonkeyPatch, requested: str) -> None:
    """8 GPUs and 8 local ranks: local rank 3 drives cuda:3."""
    fake_node(monkeypatch, gpus=8, local_rank=3, local_world_size=8)
    assert pick_device(requested) == torch.device("cuda", 3)


def test_fewer_ranks_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 ranks on an 8-GPU node is allowed: each rank takes the GPU of its own index."""
    fake_node(monkeypatch, gpus=8, local_rank=1, local_world_size=2)
    assert pick_device("auto") == torch.device("cuda", 1)


@pytest.mark.parametrize("rank", [0, 7])
def test_more_ranks_than_gpus_fails_on_every_rank(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """8 ranks on 4 GPUs fails on rank 0 as well as rank 7, so no rank is left waiting for the others.

    Rank 0 has a GPU of its own index (cuda:0 exists); a check of its index alone would let it through.
    """
    fake_node(monkeypatch, gpus=4, local_rank=rank, local_world_size=8)
    with pytest.raises(ConfigError) as info:
        pick_device("auto")
    message = str(info.value)
    # Both numbers must be in the message, as whole numbers, so the user sees what does not fit.
    assert re.search(r"\b8\b", message), message
    assert re.search(r"\b4\b", message), message


def test_scheduler_binds_one_gpu_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU visible through CUDA_VISIBLE_DEVICES with 8 local ranks (SLURM, k8s): each rank uses cuda:0."""
    fake_node(monkeypatch, gpus=1, local_rank=5, local_world_size=8, cuda_visible_devices="5")
    assert pick_device("auto") == torch.device("cuda", 0)


def test_one_gpu_shared_by_two_ranks_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU without CUDA_VISIBLE_DEVICES and 2 local ranks: both would land on it, so it is an error."""
    fake_node(monkeypatch, gpus=1, local_rank=1, local_world_size=2)
    with pytest.raises(ConfigError):
        pick_device("auto")


def test_visible_devices_does_not_excuse_several_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA_VISIBLE_DEVICES exception is for exactly one visible GPU: 2 visible and 8 ranks still fails."""
    fake_node(monkeypatch, gpus=2, local_rank=0, local_world_size=8, cuda_visible_devices="0,1")
    with pytest.raises(ConfigError):
        pick_device("auto")


def test_single_process_single_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain `python train.py` (no launcher env) on a one-GPU machine uses cuda:0."""
    fake_node(monkeypatch, gpus=1)
    assert pick_device("auto") == torch.device("cuda", 0)


# --- backend


@pytest.mark.parametrize(("device", "backend"), [("cuda", "nccl"), ("cpu", "gloo")])
def test_auto_backend_follows_device(device: str, backend: str) -> None:
    """auto gives nccl for a GPU and gloo for a CPU."""
    assert pick_backend("auto", torch.device(device)) == backend


def test_nccl_on_cpu_fails() -> None:
    """nccl cannot drive CPU tensors: asking for it on CPU is a config error."""
    with pytest.raises(ConfigError, match="nccl"):
        pick_backend("nccl", torch.device("cpu"))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_explicit_gloo_is_kept(device: str) -> None:
    """An explicit gloo is kept on either device."""
    assert pick_backend("gloo", torch.device(device)) == "gloo"


def test_a_nodes_cores_are_split_between_its_own_ranks_not_the_worlds(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 cores, 4 ranks on this node of a 32-rank world (8 nodes): 4 threads each, whatever the world size."""
    fake_node(monkeypatch, gpus=0, local_rank=1, local_world_size=4)
    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    before = torch.get_num_threads()
    try:
        set_cpu_threads()
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
