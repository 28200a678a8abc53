"""ZeRO data parallelism: optimizer states (stage 1), gradients (stage 2) and parameters (stage 3) sharded over dp.

    layout       parallel/layout.py          the flat layout of a rank's parameters: buckets padded to dp, shards
    grads.py     ScatterReducer (stage 1), ShardedGradReducer (stages 2-3): reduce-scatter into this rank's shard
    params.py    FlatParams (stages 0-2: views of one flat buffer, all-gathered in place), ShardedParams (stage 3)
    optimizer.py ZeroOptimizer: fp32 masters and AdamW over this rank's shard, CPU offload of a fraction of it
    stage3.py    gather / free hooks around each block's forward and backward, with prefetch
    checkpoints  trident/checkpoint/zero_state.py  masters and AdamW state as boxes of the logical tensors

Bytes of model state per rank. Psi: this rank's parameter count (its tp slices; all of the model at tp=1, pp=1);
Psi': the flat layout's numel, Psi plus bucket padding (each bucket rounded up to a multiple of dp: fewer than dp
elements per bucket; at stage 3 a bucket is a block, or the embeddings with the final LayerNorm); N: dp size;
b: bytes of a parameter (2 for bf16/fp16, 4 for fp32). Masters and moments are fp32, gradients accumulate and
reduce in fp32 (4 bytes), whatever the precision. "moments" is AdamW's exp_avg + exp_avg_sq of the real elements
(padding has no piece) plus a 4-byte ``step`` tensor per piece (a piece: one parameter's part of one bucket shard).

    stage  params           grads                     fp32 masters              moments   16-bit total    fp32 total
    0      b Psi' (flat)    4 Psi' (flat buffer)      4 Psi' (fp32: params)     8 Psi     18 Psi          16 Psi
    1      b Psi' (flat)    4 Psi' (flat buffer)      4 Psi'/N (fp32: params)   8 Psi/N   6 Psi+12 Psi/N  8 Psi+8 Psi/N
    2      b Psi' (flat)    4 Psi'/N (shard)+staging  4 Psi'/N (fp32: params)   8 Psi/N   2 Psi+16 Psi/N  4 Psi+12 Psi/N
    3      b Psi'/N (shard) 4 Psi'/N (shard)+staging  4 Psi'/N (fp32: params)   8 Psi/N   18 Psi/N        16 Psi/N

    Every stage, 0 included, is one optimizer (optimizer.py); at stage 0 the shard is the whole layout.

Transient, on top (not model state at rest): stages 2-3 stage gradients in a pool of fp32 buffers, one per bucket
being filled by backward plus at most two whose reduce-scatter is in flight, each at most the largest bucket
(``ShardedGradReducer.grad_tensors`` lists them). Stage 3 gathers full buckets in the parameter dtype: each model
chunk's root buckets (embeddings, final norm, head) from its forward to the end of its backward, plus the running
block and the ``parallel.zero3_prefetch`` next ones; with ``parallel.zero3_gather=step`` every bucket for the whole
step (``ShardedParams.full_bytes``, ``peak_full_bytes``; the memory estimator's ``gathered``).

Offload (parallel.offload.optimizer=cpu, ratio r): the first r of the shard's S elements (S = Psi'/N, or Psi' at
stage 0) move to host memory, pinned when CUDA exists: masters 4 rS, moments 8 rS and a host copy of their
gradients 4 rS (16 rS bytes on the host); the device keeps (1-r) of the masters and moments. With fp32 parameters
the host part needs its own masters (4 rS on the host; the device part's masters are still the parameters).

Communication per step: stages 0-1 send 2 Psi' (all-reduce, or reduce-scatter + all-gather of the parameters in
their dtype); stage 2 reduce-scatters every micro-batch (GAS x Psi') + one all-gather; stage 3 gathers each
block twice per micro-batch (forward, backward) and reduce-scatters once: 3 Psi' per micro-batch (with
``zero3_gather=step``: one gather per step, Psi' + GAS x Psi').
"""
