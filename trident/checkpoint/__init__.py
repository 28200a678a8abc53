"""Checkpoints: saved by every rank, complete or absent, loadable under any layout, and read without running code.

manager.py       Checkpointer: when to save, what goes in, resuming into this run's layout
files.py         the directory on disk: step_XXXXXXXX names, atomic publish, pruning, the JSON files
dcp.py           sharded tensor files through torch.distributed.checkpoint, and the one safe reader
state.py         what a rank saves: boxes of logical tensors under stable keys (model/, optim/, rng/)
zero_state.py    the ZeRO optimizer's fp32 masters and AdamW moments as those boxes
consolidated.py  a whole model in one safetensors file (tools/convert_checkpoint.py, tools/generate.py)
export.py        the Hugging Face GPT-2 directory
"""
