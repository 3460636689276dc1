"""The columns of the int32 tables the Triton kernels read, named once.

``partition.py`` fills the tables, ``kernels.py`` reads them (through ``tl.constexpr`` copies of
these numbers). Importing this module needs nothing but the standard library.
"""

from enum import IntEnum


class RequestColumn(IntEnum):
    """``requests [batch, len(RequestColumn)]``: one row per request."""

    Q_START = 0  # its first query row in q/out
    QO_LEN = 1
    KV_START = 2  # its first key (ragged) or the first entry of its page table in page_indices (paged)
    KV_LEN = 3
    TREE_START = 4  # its first row in tree_order
    TREE_SIZE = 5
    SPLITS = 6  # KV chunks its keys are cut into (1: not split)
    PART_START = 7  # first row of its chunks' partial states in the split workspace


class WorkColumn(IntEnum):
    """``work [items, len(WorkColumn)]``: one row per program (request, block of query rows, KV range)."""

    REQUEST = 0
    FIRST_ROW = 1  # first GQA-packed query row of the block
    KV_LO = 2  # keys [KV_LO, KV_HI) of the request
    KV_HI = 3
    SPLIT = 4  # chunk index, or -1 when the request is not split


class CountColumn(IntEnum):
    """``counts [len(CountColumn)]``: how much of the (possibly padded) work is live."""

    WORK_ITEMS = 0  # programs of the attention grid past this exit at once
    TOKENS = 1  # likewise for the split merge's grid
