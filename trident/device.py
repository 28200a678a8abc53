"""Which device a rank drives, and how many CPU threads it may use."""

from __future__ import annotations

import os

import torch

from trident.errors import ConfigError


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def device_type(requested: str) -> str:
    """``train.device`` resolved to the kind of device the ranks compute on: cuda or cpu (no check of counts)."""
    return "cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()) else "cpu"


def pick_device(requested: str) -> torch.device:
    """Checked before any process group exists, and alike on every rank of a node, so a mismatch fails
    on all of them at once (a check of this rank's index alone would end some ranks and strand the rest).
    """
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ConfigError("train.device=cuda but no GPU is visible; use train.device=auto or train.device=cpu")
    if requested == "cpu" or not has_cuda:
        return torch.device("cpu")
    count, ranks = torch.cuda.device_count(), local_world_size()
    if count == 1 and (ranks == 1 or "CUDA_VISIBLE_DEVICES" in os.environ):
        # One process per GPU, or a scheduler that shows each process only its own GPU (SLURM, k8s).
        return torch.device("cuda", 0)
    if ranks > count:
        raise ConfigError(
            f"{ranks} processes on this node but {count} GPU(s) visible; launch at most one process per GPU "
            f"(--nproc-per-node {count})"
        )
    return torch.device("cuda", local_rank())


def pick_backend(requested: str, device: torch.device) -> str:
    """``auto`` follows the device: nccl for GPUs, gloo for CPUs."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend=nccl needs GPUs; use parallel.backend=auto or gloo on CPU")
    return requested


def set_cpu_threads() -> None:
    """Share the node's cores between its ranks instead of every rank oversubscribing all of them."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size()))


def use_tensor_cores(device: torch.device) -> None:
    """ "fp32" trains with TF32 tensor-core matmuls on GPU (as Megatron and torchtitan do); the MFU peak assumes it."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
