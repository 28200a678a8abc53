"""Convert a trident checkpoint (saved under any layout) into one plain file.

    python tools/convert_checkpoint.py runs/a/checkpoints --out model.safetensors

CHECKPOINT is one checkpoint (``step_XXXXXXXX``) or a directory of them (the newest is used). ``--to
consolidated`` (the default) writes a single safetensors file: every parameter as its full logical tensor
under its canonical name, with the run config, the step and the tokenizer in the file's metadata.
``tools/generate.py`` samples from it as from the checkpoint. It runs in one process, without torchrun.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trident.checkpoint import find_resume_path
from trident.consolidated import from_checkpoint, write_consolidated
from trident.errors import TridentError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--to", choices=["consolidated"], default="consolidated", help="what to write")
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    args = parser.parse_args()
    try:
        path = find_resume_path(str(args.checkpoint), args.checkpoint, what="checkpoint")
        weights = from_checkpoint(path)
        try:
            write_consolidated(weights, args.out)
        except OSError as e:
            raise TridentError(f"cannot write --out {args.out}: {e}") from None
    except TridentError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.out}: {len(weights.tensors)} tensors from {path} (step {weights.step})", file=sys.stderr)


if __name__ == "__main__":
    main()
