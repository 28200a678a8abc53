"""Sample text from a trident checkpoint or a Hugging Face model directory, with the tokenizer saved beside it.

    python tools/generate.py outputs/2026-01-01/12-00-00/checkpoints --prompt "def main(" --tokens 200
    python tools/generate.py ~/models/llama-3.2-1b --prompt "The capital of France is" --tokens 20 --temperature 0

CHECKPOINT is one checkpoint (``step_XXXXXXXX``, saved under any layout), a directory of them (the newest is
used), the one file ``tools/convert_checkpoint.py`` makes of one, or a local Hugging Face directory of a family
trident maps (GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE, OLMoE; its tokenizer.json or tokenizer.model decodes). The
prompt is encoded as transformers' ``tokenizer(prompt)`` encodes it (a Llama tokenizer.json's BOS first). Generation
keeps a KV cache: the prompt runs once, then each new token alone; the model runs in its weights' dtype, and the cache
holds the prompt and the new tokens in that dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from torch import nn

from trident.checkpoint.files import saved_model_config
from trident.errors import CheckpointError, TridentError
from trident.models.gpt import GPT
from trident.models.kv_cache import KVCache
from trident.models.moe import moe_layers
from trident.parallel.placement import placement_of
from trident_dev.consolidated import ModelWeights, load_weights


@torch.no_grad()
def build_model(weights: ModelWeights, device: torch.device) -> GPT:
    """A one-process GPT holding ``weights`` (logical tensors: each parameter pads its own again) and their buffers
    (the sparse layers' balancing biases; zero where a source has none), in their dtype (a bf16 Hugging Face model
    runs in bf16, as transformers runs it), over the model's whole context: with RoPE, a model trained on shorter
    windows still has all the positions of the one it was started from. A sparse layer's capacity stays that of the
    trained window (models/moe.py)."""
    trained = saved_model_config(weights.config, weights.source)
    cfg = dataclasses.replace(trained, seq_len=trained.context_len)
    try:
        model = GPT(cfg)
    except ValueError as e:
        raise CheckpointError(f"{weights.source}: the saved config does not describe a trident model: {e}") from None
    for name, param in model.named_parameters():
        if name not in weights.tensors:
            raise CheckpointError(f"the checkpoint holds no tensor {name}; it is not this model's")
        try:
            param.copy_(placement_of(param).shard(weights.tensors[name]))
        except ValueError as e:
            raise CheckpointError(f"the checkpoint's {name} does not fit this model: {e}") from None
    model.to(device=device, dtype=weights.tensors["wte.weight"].dtype)
    try:
        load_balancing_state([model], weights.buffers)
    except ValueError as e:
        raise CheckpointError(f"the checkpoint's buffer {e}") from None
    for moe in moe_layers([model]).values():
        moe.seq_len = trained.seq_len  # a capacity is the trained window's, whatever the context
    return model.eval()


@torch.no_grad()
def sample(
    model: GPT,
    prompt: list[int],
    n_tokens: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
    n_pieces: int | None = None,
) -> list[int]:
    """Autoregressive sampling with a KV cache: the prompt runs through the model once, then each new token alone.
    The cache holds the prompt and the new tokens, at most the model's window; when the context reaches the window,
    the cache restarts from the last half window of tokens. Only the first ``n_pieces`` ids are drawn: a
    model.vocab_size above the tokenizer's leaves ids no piece decodes."""
    device = next(model.parameters()).device
    window = model.cfg.seq_len
    size = min(len(prompt) + n_tokens, window)  # what this generation needs, not the window (Llama 3.2's: 131072)
    ids = list(prompt)
    cache, pending = KVCache(size), ids[-window:]
    for _ in range(n_tokens):
        if cache.length + len(pending) > size:  # the window is full: start again from its second half
            cache, pending = KVCache(size), ids[-(window // 2) :]
        logits = model(torch.tensor([pending], device=device), cache)[0, -1, :n_pieces].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits[logits < kth] = -float("inf")
            probs = torch.softmax(logits, dim=-1).cpu()
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        ids.append(nxt)
        pending = [nxt]
    return ids[len(prompt) :]


@torch.no_grad()
def load_balancing_state(modules: list[nn.Module], state: dict[str, torch.Tensor]) -> None:
    """Set the sparse layers' loss-free biases from ``state`` (models/moe.py ``balancing_state``'s names; a layer
    it does not name keeps its bias), kept fp32 whatever the model's dtype: routing is fp32. Raises ValueError on a
    name that is no sparse layer's or a bias of another shape."""
    layers = {f"layers.{i}.mlp.router.expert_bias": m.router for i, m in moe_layers(modules).items()}
    for name, tensor in state.items():
        router = layers.get(name)
        if router is None or tensor.shape != router.expert_bias.shape:
            held = "no such bias" if router is None else f"shape {list(router.expert_bias.shape)}"
            raise ValueError(f"{name} {list(tensor.shape)} does not fit this model ({held})")
        if router.expert_bias.dtype != torch.float32:  # a model cast to its weights' dtype (``main``)
            router.expert_bias = router.expert_bias.float()
        router.expert_bias.copy_(tensor)  # in place: a checkpointer holds the buffer (balancing_state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 samples greedily")
    parser.add_argument("--top-k", type=int, default=50, help="0 keeps the whole vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    try:
        if args.temperature < 0 or args.tokens < 0:
            raise TridentError("--temperature and --tokens must be >= 0")
        weights = load_weights(args.checkpoint)
        model, tokenizer = build_model(weights, torch.device(args.device)), weights.load_tokenizer()
        prompt = tokenizer.encode(args.prompt)
        if not prompt:
            raise TridentError("--prompt encodes to no tokens; give some text")
        generator = torch.Generator().manual_seed(args.seed)
        out = sample(model, prompt, args.tokens, args.temperature, args.top_k, generator, tokenizer.vocab_size)
    except TridentError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"# {weights.source} (step {weights.step})", file=sys.stderr)
    # The prompt as typed: a BOS its tokenizer put first (Llama's) is no part of the text.
    typed = prompt[1:] if prompt[0] == tokenizer.bos_id else prompt
    print(tokenizer.decode(typed + out))


if __name__ == "__main__":
    main()
