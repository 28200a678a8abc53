"""A model's tiny twin: the same layers, heads, norms, activations and experts, every tensor a few elements wide.

Its ops are the model's, one for one, but their kernels cost next to nothing, so what running it takes is the
framework's: autograd's nodes, module calls, allocations, a pipeline's executor and its messages. A calibration
times a block of it alone (trident_dev/plan/calibrate.py: the framework's time per op) and runs it in small layouts
that each add one kind of work no op is (trident_dev/plan/residual.py: the framework's time per split backward action,
cp pass and recomputed layer).
"""

from __future__ import annotations

HEAD_DIM, SEQ, VOCAB = 8, 8, 64  # the twin's width per head, its tokens per sequence, its vocabulary (a block's)


def twin(model: dict) -> dict:
    """``model`` (ModelConfig's fields) at ``HEAD_DIM`` per head, the feed-forward and experts twice that wide."""
    out = dict(model)
    width = HEAD_DIM * model["n_heads"]
    out.update(d_model=width, seq_len=SEQ, max_seq_len=None)
    if model.get("d_ff") is not None:
        out["d_ff"] = 2 * width
    if isinstance(model.get("moe"), dict) and model["moe"].get("d_expert") is not None:
        out["moe"] = {**model["moe"], "d_expert": 2 * width}
    return out


def overrides(model: dict) -> list[str]:
    """The command-line overrides that make a run's model ``model``'s twin (its vocabulary kept: the data's)."""
    small = twin(model)
    keys = ["d_model", "seq_len", *(["d_ff"] if model.get("d_ff") is not None else [])]
    out = [f"model.{k}={small[k]}" for k in keys]
    if small.get("moe") != model.get("moe"):
        out.append(f"model.moe.d_expert={small['moe']['d_expert']}")
    return out
