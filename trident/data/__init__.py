"""Data: from a corpus to the batches of a training step. Imports run one way: each module imports only modules
listed above it.

    tokenizer   a sentencepiece model or a Hugging Face tokenizer.json behind one interface; its eos and vocab checks
    sources     where documents come from: text, JSON Lines and Parquet files streamed as records; the embedded corpus
    units       the corpus cut into work units by the input alone (unit k becomes shard k)
    store       the sharded token store: shards written atomically with their records, read as one sequence
    bpe         the BPE tokenizer trained on a sample of the corpus when none is given
    workers     tokenizing units into shards, in this process or in worker processes
    progress    the preparation's progress bar
    meta        a dataset directory's meta.json: its format, checked on reading; damage errors and rebuild hints
    verify      each shard against its recorded sha256, once per run (before step 1, or in the background)
    prepare     a corpus into a dataset directory (``prepare_dataset``); ``resolve_dataset``: data config -> dataset
    dataset     a prepared dataset as fixed-length windows, split into training and validation (``open_dataset``)
    sampler     which windows each rank trains on at each step
    mixture     several datasets drawn in proportion (``data.mix``), and ``open_training_data``: what a run trains on
    vocab       model.vocab_size from the data's tokenizer when the command line leaves it out
    loader      this rank's micro-batches of a step on the device, the next step's read ahead

The submodules are imported explicitly so that ``tools/prepare_data.py`` does not pay for torch.
"""
