"""The attention-state convention shared by every backend: base-2 log-sum-exp, and "no keys".

A partial attention result over a key set is ``(out, lse)`` with ``lse = log2(sum_j exp(s_j))`` of
the ``sm_scale``-scaled scores (TVM's and FlashInfer's base 2). A row with no visible keys has
``out = 0`` and ``lse = EMPTY_LSE``; merges give such a part zero weight.
"""

import math

EMPTY_LSE = -5e4  # LSE of a row with no keys (TVM's value)
LOG2E = 1.0 / math.log(2.0)  # scores times LOG2E: natural-log softmax in the base-2 domain
