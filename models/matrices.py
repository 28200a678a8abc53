"""The logical matrices a parameter holds, for optimizers that treat a matrix as a unit (Muon's Newton-Schulz).

trident fuses some matrices into one parameter, and Muon must orthogonalise each on its own (torchtitan #4532: the
fused w1/w3 orthogonalised as one matrix is a different optimizer). Every hidden matrix, as its logical (one-process)
tensor of shape ``[groups * parts * rows, cols]`` viewed as ``(groups, parts, rows, cols)``, holds ``parts``
matrices, part i being ``[:, i]`` as ``(groups * rows, cols)``:

    attn.qkv.weight     (h three dh) d      three matrices q, k, v of (h dh) x d (models/gpt.py's fused rows)
    attn.kv.weight      (g two dh) d        two matrices k, v of (g dh) x d
    mlp.experts.gate    (e f) d             e matrices f x d, one per expert (and .up)
    mlp.experts.down    (e f) d             e matrices, each the transpose of the expert's d x f down projection
    any other 2-D hidden weight             one matrix, as stored (out x in)

Each matrix is (out, in) as ``nn.Linear`` stores it (``transposed``: the parameter stores its transpose), which is
the orientation Muon's learning-rate adjustment reads. Not matrices for Muon (``None``): 1-D parameters (norms,
biases), the embeddings and the output head (``wte``, ``wpe``, ``lm_head``) and the router.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trident.config import ModelConfig

_NOT_HIDDEN = ("wte.weight", "wpe.weight", "lm_head.weight", "router.weight")


@dataclass(frozen=True)
class Matrices:
    """A logical tensor ``(groups * parts * rows, cols)`` as ``parts`` matrices of ``(groups * rows, cols)``."""

    groups: int = 1
    parts: int = 1
    transposed: bool = False
    names: tuple[str, ...] = ()  # what each part is, for the start-up summary

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The logical tensor's matrices, each (out, in), contiguous copies."""
        four = t.reshape(self.groups, self.parts, -1, t.shape[-1])
        mats = [four[:, i].reshape(-1, t.shape[-1]) for i in range(self.parts)]
        return [m.T.contiguous() if self.transposed else m.contiguous() for m in mats]

    def join(self, mats: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write ``mats`` (as ``split`` returns them) back into the logical tensor ``out``."""
        four = out.view(self.groups, self.parts, -1, out.shape[-1])
        for i, m in enumerate(mats):
            four[:, i] = (m.T if self.transposed else m).reshape(self.groups, -1, out.shape[-1])
        return out

    def shape(self, logical: tuple[int, ...]) -> tuple[int, int]:
        """One matrix's (out, in)."""
        rows, cols = logical[0] // self.parts, logical[-1]
        return (cols, rows) if self.transposed else (rows, cols)

    def describe(self, logical: tuple[int, ...]) -> str:
        out, inp = self.shape(logical)
        what = ", ".join(self.names) if self.names else f"{self.parts} matrices"
        return f"{what} of {out}x{inp}" if self.parts > 1 else f"{out}x{inp}"


def matrices_of(name: str, shape: tuple[int, ...], m: ModelConfig) -> Matrices | None:
    """The matrices of the parameter ``name`` (a model chunk's name, e.g. ``layers.3.attn.qkv.weight``) of logical
    ``shape``; None where it is not a hidden matrix."""
    if len(shape) != 2 or name.endswith(_NOT_HIDDEN):
        return None
    if name.endswith("attn.qkv.weight"):
        return Matrices(m.n_heads, 3, names=("q", "k", "v"))
    if name.endswith("attn.kv.weight"):
        return Matrices(m.n_kv_heads or m.n_heads, 2, names=("k", "v"))
    if name.endswith(("experts.gate", "experts.up", "experts.down")):
        experts = m.moe.experts
        return Matrices(1, experts, transposed=name.endswith("down"), names=(f"{experts} experts",))
    return Matrices()
