"""Host side of the Triton backend: tile choice, the split-KV heuristic and the work partition.

``build_partition`` runs once per plan (``TritonBackend.plan``) from the plan's host arrays, so a
run only launches kernels: no host synchronisation. The partition is immutable and holds no
scratch memory (the split workspace is allocated per run), so layers on several threads may share it.

Work list: one item per (request, block of ``BLOCK_M`` GQA-packed query rows, KV chunk), for each
KV head (grid axis 1). Items of one request and chunk are adjacent, so the row blocks that share
a KV chunk run side by side and read it from L2 rather than HBM. The tables' columns are named in
``tables.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...plan import TreeAttentionPlan
from ..base import AttentionSpec
from .tables import CountColumn, RequestColumn, WorkColumn

MAX_HEAD_DIM = 576  # q/k: MLA's absorbed width (512 latent + 64 RoPE dims), the widest compiled (aot.py)
MAX_V_HEAD_DIM = 512  # v: MLA's latent, the widest V compiled and checked for spills (aot.py)
MAX_SINGLE_BLOCK_DIM = 256  # head dims up to this take one padded block; wider ones a power of two plus a tail
MIN_CHUNK = 256  # shortest KV chunk worth a split: below it, writing and merging partials costs more
DEFAULT_SMS = 132  # H100/H200; used when no CUDA device answers (CPU interpreter runs)


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # GQA-packed query rows per program
    block_n: int  # keys per tile
    block_d: int  # q/k head dim padded to a power of two (>= 16, the smallest tl.dot size), or its main block
    block_dt: int  # q/k dims past block_d, padded (0: none; see head_blocks)
    block_dv: int  # v head dim padded
    num_warps: int
    num_stages: int
    fp32_dot: bool  # dots in fp32 "ieee" (fp32 inputs; bf16 under the interpreter, whose bf16 dot is wrong)


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """``BLOCK_D``: the head dim padded to a power of two, at least 16 (the smallest ``tl.dot`` size)."""
    return max(16, next_pow2(head_dim))


def cdiv(a, b):
    return -(-a // b)


def head_blocks(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_DT)`` for a q/k head dim: one padded block up to 256 dims; a wider one (MLA's
    512 + 64) as its largest power of two plus a padded tail, two dots, rather than padding 576 to 1024."""
    if head_dim <= MAX_SINGLE_BLOCK_DIM:
        return padded_head_dim(head_dim), 0
    main = 1 << (head_dim.bit_length() - 1)
    return main, padded_head_dim(head_dim - main) if head_dim > main else 0


def choose_tiles(dtype: torch.dtype, head_dim: int, max_rows: int, *, v_head_dim: int | None = None,
                 arch: int = 90, interpret: bool = False) -> TileConfig:
    """Tiles for ``max_rows`` GQA-packed query rows per request (``qo_len * group``) on ``sm_{arch}``.

    ``BLOCK_M`` is the rows rounded up to a power of two (at least 16, the smallest ``tl.dot``),
    capped by what the fp32 accumulator leaves in registers. Every choice below is free of register
    spills in the compiled SASS of both sm_80 and sm_90 when K and V share their strides (checked
    by ``aot.py`` over all variants; a V strided unlike K spills on sm_90's 128-row tiles at 64 < d <= 128):

    - fp16/bf16, d <= 64: 64-key tiles, 4 warps (8 for 128 rows).
    - fp16/bf16, 64 < d <= 128: 16-32 rows: 32-key tiles, 4 warps; 64-128 rows: 64 keys, 8 warps.
    - 128-row tiles only on sm_90 (where they run as warpgroup MMA): sm_80's 128-row tile spills.
    - fp16/bf16, d = 256: 32 rows, 32-key tiles, 4 warps.
    - fp32: exact fp32 FMA dots (see test_triton_compile.py), 16 x 16 tiles, 4 warps.
    - V with a head dim of its own: the rules above for the wider of the two blocks.
    - q/k or v wider than 256 (MLA: 576 = 512 + 64, V 512), fp16/bf16: 16 rows, 16-key tiles, 8 warps.
      Wider key tiles or 4 warps spill on both archs; 32 rows spill on sm_80, and on sm_90 with sinks.

    Which of the spill-free choices is fastest needs a GPU: ``bench/gpu.py``.
    """
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if not 1 <= head_dim <= MAX_HEAD_DIM or not 1 <= v_head_dim <= MAX_V_HEAD_DIM:
        raise ValueError(f"head dims {head_dim}/{v_head_dim} are not supported by the triton backend "
                         f"(q/k 1..{MAX_HEAD_DIM}, v 1..{MAX_V_HEAD_DIM})")
    block_d, block_dt = head_blocks(head_dim)
    block_dv = padded_head_dim(v_head_dim)
    widest = max(block_d + block_dt, block_dv)
    rows = max(16, next_pow2(max_rows))
    if dtype == torch.float32:
        block_m, block_n, num_warps, num_stages = 16, 16, 4, 2
    elif widest > 256:
        block_m, block_n, num_warps, num_stages = 16, 16, 8, 2
    elif widest == 256:
        block_m, block_n, num_warps, num_stages = 32, 32, 4, 2
    else:
        block_m = min(rows, 128 if arch >= 90 else 64)
        if widest <= 64:
            block_n, num_warps = 64, (8 if block_m == 128 else 4)
        elif block_m <= 32:
            block_n, num_warps = 32, 4
        else:
            block_n, num_warps = 64, 8
        num_stages = 3
    return TileConfig(block_m, block_n, block_d, block_dt, block_dv, num_warps, num_stages,
                      fp32_dot=dtype == torch.float32 or (interpret and dtype == torch.bfloat16))


def device_arch(device: torch.device) -> int:
    """``sm_XY`` as ``XY`` for CUDA devices; 90 (the tiles of Hopper) for the CPU interpreter."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return 90


def split_chunk(rowblocks: np.ndarray, kv_lens: np.ndarray, num_kv_heads: int, block_n: int, num_sms: int) -> int:
    """KV chunk length for split-KV, or 0 for no split.

    Without splits there are ``sum(rowblocks) * h_kv`` programs, each streaming its request's whole
    KV. Streaming needs several resident programs per SM to keep enough loads in flight, so with
    fewer than two per SM the total KV work is cut into about four programs per SM, with one chunk
    length for the whole batch: long requests get more chunks and all programs do similar work.
    A split must at least halve the longest request, and chunks are never shorter than MIN_CHUNK.
    """
    programs = int(rowblocks.sum()) * num_kv_heads
    if programs == 0 or programs >= 2 * num_sms:
        return 0
    work = int((rowblocks * kv_lens).sum())
    longest = int(kv_lens.max())
    raw = max(MIN_CHUNK, cdiv(work, cdiv(4 * num_sms, num_kv_heads)))
    splits = round(longest / raw)  # of the longest request; then even chunks, so no sliver is left over
    if splits < 2:
        return 0
    return cdiv(cdiv(longest, splits), block_n) * block_n


@dataclass(frozen=True)
class WorkPartition:
    """Device int32 tables the kernels read, plus the launch sizes and variant values; built once per plan."""

    tiles: TileConfig
    requests: torch.Tensor  # [B, len(RequestColumn)]
    work: torch.Tensor  # [grid_work, len(WorkColumn)]
    counts: torch.Tensor  # [len(CountColumn)]
    token_request: torch.Tensor  # [grid_tokens]: request of each query token
    tree_order: torch.Tensor
    page_indices: torch.Tensor
    row_positions: torch.Tensor  # [total_q]: each query row's position (sliding window only)
    node_depths: torch.Tensor  # [N], in tree_order's rows: a tree key's position is prefix + depth (window only)
    partial_rows: int  # token rows of the fp32 split workspace a run allocates (0: nothing split)
    grid_work: int
    grid_tokens: int
    launch_merge: bool  # any split (always True in a graph envelope, whose contents change)
    chunk: int  # KV chunk length of split requests (0: none split)
    window: int = 0  # sliding window (0: none)
    softcap: float = 0.0  # logit soft-cap (0: none)

    @property
    def op_args(self) -> tuple:
        """The partition as the trailing arguments of ``torch.ops.treeattn.triton_tree_attention``."""
        t = self.tiles
        return (self.requests, self.work, self.counts, self.token_request, self.tree_order, self.page_indices,
                self.row_positions, self.node_depths, self.window, self.softcap,
                t.block_m, t.block_n, t.block_d, t.block_dt, t.block_dv, t.num_warps, t.num_stages, t.fp32_dot,
                self.partial_rows, self.grid_work, self.grid_tokens, self.launch_merge)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def window_floors(plan: TreeAttentionPlan, window: int | None, group: int, block_m: int) -> np.ndarray:
    """Per row block of ``block_m`` rows (request-major, ``cdiv(qo_len * group, block_m)`` per request), the
    first key some row of it can see through its window (0 without a window): no key before it is read.
    A prefix key's position is its index; tree node ``a`` sits at position ``prefix + depth(a)`` and index
    ``prefix + a``. Numbered parents first (as every parent array numbers a tree), ``depth(a) <= a``, so no
    key below the block's lowest window start ``w`` is visible; a valid ``tree_order`` numbered otherwise
    may put a node of depth ``>= w - prefix`` at a lower index: the floor is then the first such node."""
    qo, kv, n = (x.astype(np.int64) for x in (plan.qo_lens, plan.kv_lens, plan.tree_sizes))
    blocks = cdiv(qo * group, block_m)
    floors = np.zeros(int(blocks.sum()), np.int64)
    if window is None or not plan.total_q:
        return floors
    first_block = np.cumsum(blocks) - blocks
    req = np.repeat(np.arange(plan.batch_size), qo)
    tok = np.arange(req.shape[0]) - plan.q_starts[req]
    row_lo = np.maximum(plan.row_positions - (window - 1), 0)
    floors[:] = np.iinfo(np.int64).max
    for row in (tok * group, tok * group + group - 1):  # a token's rows lie in one or two blocks
        np.minimum.at(floors, first_block[req] + row // block_m, row_lo)
    node_req = np.repeat(np.arange(plan.batch_size), n)
    local = np.arange(node_req.shape[0]) - np.repeat(np.cumsum(n) - n, n)
    depths = plan.node_depths
    for b in np.unique(node_req[depths > local]):  # trees not numbered parents first
        tree_lo, d = kv[b] - n[b], depths[plan.tree_starts[b]:plan.tree_starts[b] + n[b]]
        lowest = np.full(int(d.max()) + 2, n[b])  # lowest[x]: the lowest index of a node of depth >= x
        np.minimum.at(lowest, d, np.arange(n[b]))
        lowest = np.minimum.accumulate(lowest[::-1])[::-1]
        at = slice(first_block[b], first_block[b] + blocks[b])
        deep = np.minimum(np.maximum(floors[at] - tree_lo, 0), lowest.shape[0] - 1)
        floors[at] = np.minimum(floors[at], tree_lo + lowest[deep])
    return floors


def window_starts(floors: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Per request, the first key some row's window reaches: the lowest of its row blocks' ``floors``
    (``window_floors``; ``blocks`` per request), 0 for a request without rows."""
    starts = np.zeros(blocks.shape[0], np.int64)
    has = blocks > 0
    if has.any():
        starts[has] = np.minimum.reduceat(floors, (np.cumsum(blocks) - blocks)[has])
    return starts


def default_chunk(plan: TreeAttentionPlan, spec: AttentionSpec, tiles: TileConfig) -> int:
    """``split_chunk`` for ``plan``: the keys a request reads are those from its window's start on."""
    rowblocks = cdiv(plan.qo_lens.astype(np.int64) * spec.group, tiles.block_m)
    floors = window_floors(plan, spec.sliding_window, spec.group, tiles.block_m)
    spans = plan.kv_lens.astype(np.int64) - window_starts(floors, rowblocks)
    return split_chunk(rowblocks, spans, spec.num_kv_heads, tiles.block_n, num_sms(plan.device))


def partition_arrays(plan: TreeAttentionPlan, group: int, tiles: TileConfig, chunk: int,
                     window: int | None = None) -> dict[str, np.ndarray]:
    """Host int32 tables for a given KV ``chunk`` (0: no split). With a ``window`` a request's work starts
    at its ``window_starts`` key, and only what follows is cut into chunks."""
    qo, kv = plan.qo_lens.astype(np.int64), plan.kv_lens.astype(np.int64)
    rowblocks = cdiv(qo * group, tiles.block_m)
    floors = window_floors(plan, window, group, tiles.block_m)
    first = window_starts(floors, rowblocks)
    span = kv - first
    batch = qo.shape[0]
    splits = np.where((span > chunk) & (chunk > 0), cdiv(span, max(chunk, 1)), 1)
    is_split = (splits > 1) & (qo > 0)
    part_rows = np.where(is_split, splits * qo, 0)

    requests = np.zeros((batch, len(RequestColumn)), np.int64)
    requests[:, RequestColumn.Q_START] = plan.q_starts
    requests[:, RequestColumn.QO_LEN] = qo
    requests[:, RequestColumn.KV_START] = plan.kv_starts if plan.kind == "ragged" else plan.page_starts
    requests[:, RequestColumn.KV_LEN] = kv
    requests[:, RequestColumn.TREE_START] = plan.tree_starts
    requests[:, RequestColumn.TREE_SIZE] = plan.tree_sizes
    requests[:, RequestColumn.SPLITS] = splits
    requests[:, RequestColumn.PART_START] = np.cumsum(part_rows) - part_rows

    items = rowblocks * splits
    req = np.repeat(np.arange(batch), items)
    local = np.arange(req.shape[0]) - np.repeat(np.cumsum(items) - items, items)
    split_idx, block = local // rowblocks[req], local % rowblocks[req]
    work = np.zeros((req.shape[0], len(WorkColumn)), np.int64)
    work[:, WorkColumn.REQUEST] = req
    work[:, WorkColumn.FIRST_ROW] = block * tiles.block_m
    chunk_lo = first[req] + np.where(is_split[req], split_idx * chunk, 0)
    work[:, WorkColumn.KV_HI] = np.where(is_split[req], np.minimum(chunk_lo + chunk, kv[req]), kv[req])
    # Each row block's reading starts at its own window floor (an item may then read nothing).
    work[:, WorkColumn.KV_LO] = np.maximum(chunk_lo, floors[(np.cumsum(rowblocks) - rowblocks)[req] + block])
    work[:, WorkColumn.SPLIT] = np.where(is_split[req], split_idx, -1)
    token_request = np.repeat(np.arange(batch), qo)
    counts = np.zeros(len(CountColumn), np.int64)
    counts[CountColumn.WORK_ITEMS], counts[CountColumn.TOKENS] = work.shape[0], token_request.shape[0]
    return {
        "requests": requests.astype(np.int32),
        "work": work.astype(np.int32),
        "counts": counts.astype(np.int32),
        "token_request": token_request.astype(np.int32),
        "partial_rows": int(part_rows.sum()),
        "any_split": bool(is_split.any()),
    }


def max_rows_per_request(plan: TreeAttentionPlan, group: int) -> int:
    return int(plan.qo_lens.max()) * group if plan.batch_size else 1


def plan_tiles(spec: AttentionSpec, max_rows: int) -> TileConfig:
    """``choose_tiles`` for ``spec`` on its device (Hopper's tiles under the interpreter)."""
    return choose_tiles(spec.dtype, spec.head_dim, max_rows, v_head_dim=spec.v_head_dim,
                        arch=device_arch(spec.device), interpret=spec.device.type == "cpu")


def build_partition(plan: TreeAttentionPlan, spec: AttentionSpec, *, kv_chunk: int | None = None,
                    tiles: TileConfig | None = None) -> WorkPartition:
    """The work partition of ``plan`` for the heads, head dims, dtype and variants of ``spec``.

    ``kv_chunk`` overrides the split heuristic (0: never split; > 0: that chunk length, rounded
    up to a multiple of ``BLOCK_N``), mainly for tests; ``tiles`` overrides the tile choice.
    """
    group, device, window = spec.group, plan.device, spec.sliding_window
    if tiles is None:
        tiles = plan_tiles(spec, max_rows_per_request(plan, group))
    if kv_chunk is None:
        chunk = default_chunk(plan, spec, tiles)
    else:
        chunk = cdiv(int(kv_chunk), tiles.block_n) * tiles.block_n
    host = partition_arrays(plan, group, tiles, chunk, window)
    to_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
    positions = {"row_positions": None, "node_depths": None}
    if window is not None:  # int32: positions are key indices or below
        positions = {"row_positions": to_dev(plan.row_positions.astype(np.int32)),
                     "node_depths": to_dev(plan.node_depths.astype(np.int32))}
    return WorkPartition(
        tiles=tiles,
        requests=to_dev(host["requests"]),
        work=to_dev(host["work"]),
        counts=to_dev(host["counts"]),
        token_request=to_dev(host["token_request"]),
        tree_order=_non_empty(plan.tree_order, device),
        page_indices=_non_empty(plan.page_indices, device),
        **{name: _non_empty(table, device) for name, table in positions.items()},
        partial_rows=host["partial_rows"],
        grid_work=host["work"].shape[0],
        grid_tokens=host["token_request"].shape[0],
        launch_merge=host["any_split"],
        chunk=chunk if host["any_split"] else 0,
        window=window or 0,
        softcap=spec.logit_softcap or 0.0,
    )


def _non_empty(index: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Kernels take a pointer even to an absent or empty index array; give them a real one."""
    return index if index is not None and index.numel() else torch.zeros(2, dtype=torch.int32, device=device)
