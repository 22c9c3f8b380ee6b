"""Context parallelism: one sequence's attention split over the ranks of a process group.

Each rank holds a shard of the sequence: one or two *pieces* of equal length, in the
order `Sharding` gives them. Keys and values visit the other ranks; every (query piece,
key piece) pair that may hold an allowed (q, k) pair is one call of the compiled
kernel at the two pieces' absolute offsets (the kernels take absolute positions), and
the partial outputs merge exactly through their log-sum-exps. Each pair's forward is the
one a single-device call of that pair would run (`Kernel.forward_role`: on Hopper the
Gluon forward where it takes the call); the pieces' backward is portable (the Gluon dK/dV
and dQ kernels run single-device backwards only, so far). The backward sends the
keys and values again; each rank adds dQ for its own queries, and sends the dK/dV it
computed for a visiting piece back to that piece's owner.

    sharding = Sharding.of(group, "zigzag")
    q, k, v = (sharding.shard(t) for t in (q, k, v))          # this rank's pieces
    out = context_parallel_attention(kernel, q, k, v, group=group, doc_q=doc, doc_k=doc)

One module a job:
- sharding.py: which pieces each rank holds (the schemes), and cutting and joining them;
- schedule.py: which piece pairs each rank computes, and which hops send keys;
- agreement.py: what every rank must share, checked in one all-gather before any transfer;
- call.py: `context_parallel_attention`, the call checked on each rank;
- ring.py: the hops of the forward and the backward, and the exact merge of partials.
"""
from .sharding import SCHEMES, Sharding
from .schedule import Schedule, make_schedule, piece_classification
from .agreement import Signature, agree
from .ring import merge_partial
from .call import context_parallel_attention

__all__ = ["SCHEMES", "Sharding", "Schedule", "make_schedule", "piece_classification",
           "Signature", "agree", "merge_partial", "context_parallel_attention"]
