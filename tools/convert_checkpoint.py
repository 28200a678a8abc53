"""Convert a trident checkpoint (saved under any layout) into one plain file, or into a Hugging Face GPT-2.

    python tools/convert_checkpoint.py runs/a/checkpoints --out model.safetensors
    python tools/convert_checkpoint.py runs/a/checkpoints --to hf --out gpt2-mine

CHECKPOINT is one checkpoint (``step_XXXXXXXX``), a directory of them (the newest is used), or
the one file ``--to consolidated`` made of one. It runs in one process, without torchrun.

``--to consolidated`` (the default) writes a single safetensors file: every parameter as its full logical tensor
under its canonical name, with the run config, the step and the tokenizer in the file's metadata.
``tools/generate.py`` samples from it as from the checkpoint.

``--to hf`` writes a directory that ``transformers.GPT2LMHeadModel.from_pretrained(DIR)`` loads (config.json and
model.safetensors) and gives our logits, with the run's sentencepiece ``tokenizer.model`` beside it (load it with
``sentencepiece``; it is not a GPT-2 BPE). The mapping is in ``trident/checkpoint/export.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trident.checkpoint.consolidated import load_weights, write_consolidated
from trident.checkpoint.export import check_out_dir, write_hf
from trident.errors import TridentError

TARGETS = ("consolidated", "hf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--to", default="consolidated", help=f"what to write: {' or '.join(TARGETS)}")
    parser.add_argument(
        "--out", type=Path, required=True, help="the .safetensors file (consolidated) or directory (hf)"
    )
    args = parser.parse_args()
    try:
        if args.to not in TARGETS:
            raise TridentError(f"--to {args.to} is not a target; use --to consolidated or --to hf")
        if args.to == "hf":
            check_out_dir(args.out)
        weights = load_weights(args.checkpoint, what="checkpoint")
        try:
            if args.to == "hf":
                what = ", ".join(write_hf(weights, args.out))
            else:
                write_consolidated(weights, args.out)
                what = f"{len(weights.tensors)} tensors"
        except OSError as e:
            raise TridentError(f"cannot write --out {args.out}: {e}") from None
    except TridentError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.out}: {what} from {weights.source} (step {weights.step})", file=sys.stderr)


if __name__ == "__main__":
    main()
