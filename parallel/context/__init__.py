"""Context parallelism: one sequence split over the ranks of a cp group, attention exact across the split.

span.py       which global tokens a rank holds (index, document id) and the mask between two spans
split.py      the head-tail split of a sequence over cp ranks, its inverse, and the causal balance
batch.py      a cp rank's part of a micro-batch, positions computed on the whole window first
core.py       attention of one (query block, key block) pair: (output, log-sum-exp), and its backward
allgather.py  gather K/V over cp before attention, reduce-scatter their gradients after
ring.py       pass K/V blocks around the cp ring, merging partial outputs by their log-sum-exp (the quarters of
              a block the causal mask leaves empty skipped)
ulysses.py    all-to-all from sequence-split to head-split and back
attention.py  ``context_attention(q, k, v, span, group, comm)``: the one entry point, by ``parallel.cp_comm``
"""
