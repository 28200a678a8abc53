"""Convert a model: a trident checkpoint (saved under any layout) into one plain file or a Hugging Face model, and a
Hugging Face directory (GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE, OLMoE) into a trident checkpoint.

    python tools/convert_checkpoint.py runs/a/checkpoints --out model.safetensors
    python tools/convert_checkpoint.py runs/a/checkpoints --to hf --out llama-mine
    python tools/convert_checkpoint.py ~/models/llama-3.2-1b --from hf --out ck/llama-1b

SOURCE is one checkpoint (``step_XXXXXXXX``), a directory of them (the newest is used), the one file
``--to consolidated`` made of one, or (``--from hf``) a local Hugging Face model directory. It runs in one
process, without torchrun. Nothing is downloaded.

``--to consolidated`` (the default from a checkpoint) writes a single safetensors file: every parameter as its
full logical tensor under its canonical name, with the run config, the step and the tokenizer in the file's
metadata. ``tools/generate.py`` samples from it as from the checkpoint.

``--to hf`` writes a directory that ``transformers.GPT2LMHeadModel.from_pretrained(DIR)`` (GPT-2 blocks),
``transformers.LlamaForCausalLM.from_pretrained(DIR)`` (RMSNorm, SwiGLU, RoPE) or the class of the model's family
(Qwen3ForCausalLM with q/k norms; MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM with experts) loads with
our logits (config.json, model.safetensors), with the model's tokenizer file beside it. Another block mix is
refused, and so is router state the dropless expert classes have no place for (a capacity, a moved balancing bias).

``--to checkpoint`` (the default with ``--from hf``) writes ``OUT/step_00000000``, a trident checkpoint of the
weights alone (no optimizer state): ``checkpoint.init_from=OUT`` starts a run from it, and ``--to hf`` and
``tools/generate.py`` read it. The mapping is ``trident/checkpoint/hf.py``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trident.checkpoint.hf_dir import is_hf_dir
from trident.errors import TridentError
from trident_dev.consolidated import load_weights, write_checkpoint, write_consolidated
from trident_dev.export import check_out_dir, write_hf

SOURCES = ("checkpoint", "hf")
TARGETS = ("consolidated", "hf", "checkpoint")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, metavar="SOURCE")
    parser.add_argument("--from", dest="source", default="checkpoint", help=f"what SOURCE is: {' or '.join(SOURCES)}")
    parser.add_argument("--to", default=None, help=f"what to write: {', '.join(TARGETS)}")
    parser.add_argument(
        "--out", type=Path, required=True, help="the .safetensors file (consolidated) or directory (hf, checkpoint)"
    )
    args = parser.parse_args()
    try:
        if args.source not in SOURCES:
            raise TridentError(f"--from {args.source} is not a source; use --from checkpoint or --from hf")
        to = args.to or ("checkpoint" if args.source == "hf" else "consolidated")
        if to not in TARGETS:
            raise TridentError(f"--to {to} is not a target; use --to consolidated or --to hf")
        if to == "hf":
            check_out_dir(args.out)
        if args.source == "hf" and not is_hf_dir(args.checkpoint):
            raise TridentError(f"--from hf: {args.checkpoint} is not a Hugging Face model directory (no config.json)")
        weights = load_weights(args.checkpoint, what="checkpoint")
        out = args.out
        try:
            if to == "hf":
                what = ", ".join(write_hf(weights, out))
            elif to == "checkpoint":
                out = write_checkpoint(weights, out)
                what = f"{len(weights.tensors)} tensors"
            else:
                write_consolidated(weights, out)
                what = f"{len(weights.tensors)} tensors"
        except OSError as e:
            raise TridentError(f"cannot write --out {args.out}: {e}") from None
    except TridentError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}: {what} from {weights.source} (step {weights.step})", file=sys.stderr)


if __name__ == "__main__":
    main()
