"""Data: ``prepare`` turns text into a tokenized dataset, ``dataset`` reads it as fixed-length
windows, ``sampler`` decides which windows each rank trains on at each step.

The submodules are imported explicitly so that ``tools/prepare_data.py`` does not pay for torch.
"""
