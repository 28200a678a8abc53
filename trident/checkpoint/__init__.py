"""Checkpoints: saved by every rank, complete or absent, loadable under any layout, and read without running code.

manager.py       Checkpointer: when to save, what goes in, resuming into this run's layout
files.py         the directory on disk: step_XXXXXXXX names, atomic publish, pruning, the JSON files
background.py    checkpoint.async: the state staged in host memory, written by a writer process, published
dcp.py           sharded tensor files through torch.distributed.checkpoint, and the one safe reader
sharded.py       Sharded: the boxes of a logical tensor a rank saves (apart from dcp.py: no DCP import)
state.py         what a rank saves: boxes of logical tensors under stable keys (model/, optim/, rng/)
zero_state.py    the ZeRO optimizer's fp32 masters and AdamW moments as those boxes
consolidated.py  a whole model in one process: from a checkpoint, one safetensors file or a Hugging Face directory
hf.py            the one mapping to and from Hugging Face GPT-2 and Llama: names, row layouts, config.json
hf_dir.py        a local Hugging Face directory, read a slice at a time without running code from it
export.py        the Hugging Face directory written from a model
init_from.py     checkpoint.init_from: a run's shape from a checkpoint or Hugging Face model, each rank its shard
"""
