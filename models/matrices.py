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

from trident.config import ModelConfig
from trident.parallel.zero.muon import Matrices

_NOT_HIDDEN = ("wte.weight", "wpe.weight", "lm_head.weight", "router.weight")


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
