"""The torch-DTensor twin of models/gpt.py's GPT that ``tools/bench.py tp`` (trident_dev/bench/tp.py) measures trident's
tensor parallelism against: the same GPT written with nn.Linear / nn.Embedding / nn.LayerNorm under the same parameter
names and shapes (so it loads a trident model's state dict), and Megatron's layout over it with
torch.distributed.tensor.parallel's styles (which take those plain modules), with or without sequence parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trident.config import ModelConfig


class TorchAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, self.head_dim = cfg.d_model, cfg.head_size
        self.qkv = nn.Linear(d, 3 * d, bias=cfg.bias)
        self.proj = nn.Linear(d, d, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # qkv is laid out head by head, (h three d): a colwise block of rows holds whole heads, h = local heads.
        q, k, v = rearrange(self.qkv(x), "b t (h three d) -> three b h t d", three=3, d=self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class TorchMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class TorchBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = TorchAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = TorchMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    """models/gpt.py's GPT with the same parameter names, in plain modules; lm_head shares wte's weight."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): TorchBlock(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.sequence_shard = (0, 1)  # (this rank's shard, shards): which positions the residual stream holds

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        shard, shards = self.sequence_shard
        n = idx.shape[1] // shards
        x = self.wte(idx) + self.wpe(torch.arange(shard * n, (shard + 1) * n, device=idx.device))
        for block in self.layers.values():
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _replicated_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _local_output(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    return output.to_local()


def parallelize_torch_gpt(model: TorchGPT, mesh: DeviceMesh, sequence_parallel: bool) -> TorchGPT:
    """Megatron's layout with torch's styles; the residual stream is Replicate, or Shard(1) with SP."""
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    for i in model.layers:
        p = f"layers.{i}."
        plan[p + "attn.qkv"] = ColwiseParallel()
        plan[p + "attn.proj"] = RowwiseParallel(output_layouts=stream)
        plan[p + "mlp.fc"] = ColwiseParallel()
        plan[p + "mlp.proj"] = RowwiseParallel(output_layouts=stream)
        if sequence_parallel:
            plan[p + "ln_1"] = SequenceParallel()
            plan[p + "ln_2"] = SequenceParallel()
            plan[p + "attn"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
            plan[p + "mlp"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
        # wpe takes this rank's shard of the positions, so its output is the residual stream's shard.
        plan["wpe"] = SequenceParallel(sequence_dim=0, use_local_output=True)
    parallelize_module(model, mesh, plan)
    if not sequence_parallel:
        # Replicated DTensor parameters with local inputs and outputs: clip_grad_norm_ and AdamW's foreach
        # kernels refuse a mix of plain tensors and DTensors.
        for name in ["wpe", "ln_f", *(f"layers.{i}.{ln}" for i in model.layers for ln in ("ln_1", "ln_2"))]:
            distribute_module(model.get_submodule(name), mesh, None, _replicated_input, _local_output)
    model.lm_head.weight = model.wte.weight  # parallelize_module distributed the tied weight twice: tie it again
    if sequence_parallel:
        model.sequence_shard = (mesh.get_local_rank(), mesh.size())
    return model
