"""The keys and values of the tokens seen so far, per layer, so that generation runs each new token through the
model once instead of the whole context again.

One process, one model (tp = pp = 1). ``GPT.forward(ids, cache)`` reads ``cache.length`` as the position of
``ids``' first token, each attention layer appends its keys and values (after RoPE) and attends to everything
held, and the model then advances ``length``. Storage is allocated once per layer, for ``max_len`` tokens (what the
generation needs: tools/generate.py asks for the prompt and the new tokens), in the dtype of the keys and values,
which is the model's.

A sparse layer with a capacity (models/moe.py) keeps each sequence's (token, expert) pairs per expert in token
order, at most the capacity of each expert per sequence; the cache holds, per sparse layer, how many pairs each
sequence has sent each expert so far, so that a new token's pairs are placed after them and a decode keeps the
pairs a full forward of the whole sequence keeps.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._routed: dict[object, torch.Tensor] = {}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``[b, heads, t, d]`` at positions [length, length + t); return all keys and values
        held for this layer, the new ones included."""
        end = self.length + k.shape[-2]
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; {end} asked (crop the context first)")
        if layer not in self._k:
            shape = (*k.shape[:-2], self.max_len, k.shape[-1])
            self._k[layer], self._v[layer] = k.new_empty(shape), v.new_empty(shape)
        self._k[layer][..., self.length : end, :] = k
        self._v[layer][..., self.length : end, :] = v
        return self._k[layer][..., :end, :], self._v[layer][..., :end, :]

    def routed(self, layer: object, batch: int, experts: int, device: torch.device) -> torch.Tensor:
        """The pairs each of the ``batch`` sequences has sent each expert of sparse layer ``layer`` (the MoE module)
        so far, ``[batch, experts]`` int64: zeros at first; the layer adds the new tokens' pairs in place."""
        if layer not in self._routed:
            self._routed[layer] = torch.zeros(batch, experts, dtype=torch.int64, device=device)
        return self._routed[layer]

    def advance(self, t: int) -> None:
        self.length += t

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the storage (None before the first layer appends)."""
        return next(iter(self._k.values())).dtype if self._k else None

    @property
    def nbytes(self) -> int:
        """The bytes of storage allocated, keys and values of every layer."""
        return sum(t.nbytes for held in (self._k, self._v) for t in held.values())
