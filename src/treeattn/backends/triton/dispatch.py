"""Host side of the Triton backend: tile choice, the split-KV heuristic and the work partition.

Everything here runs once per plan (``plan.cache["triton"]``) from the plan's host arrays, so a
run only launches kernels: no host synchronisation and, once the workspace exists, no allocation.

Work list: one item per (request, block of ``BLOCK_M`` GQA-packed query rows, KV chunk), for each
KV head (grid axis 1). Items of one request and chunk are adjacent, so the row blocks that share
a KV chunk run side by side and read it from L2 rather than HBM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...plan import TreeAttentionPlan

MAX_HEAD_DIM = 256
MIN_CHUNK = 256  # shortest KV chunk worth a split: below it, writing and merging partials costs more
DEFAULT_SMS = 132  # H100/H200; used when no CUDA device answers (CPU interpreter runs)


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # GQA-packed query rows per program
    block_n: int  # keys per tile
    block_d: int  # head dim padded to a power of two (>= 16, the smallest tl.dot size)
    num_warps: int
    num_stages: int
    fp32_dot: bool  # dots in fp32 "ieee" (fp32 inputs; bf16 under the interpreter, whose bf16 dot is wrong)


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def cdiv(a, b):
    return -(-a // b)


def choose_tiles(dtype: torch.dtype, head_dim: int, max_rows: int, *, arch: int = 90,
                 interpret: bool = False) -> TileConfig:
    """Tiles for ``max_rows`` GQA-packed query rows per request (``qo_len * group``) on ``sm_{arch}``.

    ``BLOCK_M`` is the rows rounded up to a power of two (at least 16, the smallest ``tl.dot``),
    capped by what the fp32 accumulator leaves in registers. Every choice below is free of register
    spills in the compiled SASS of both sm_80 and sm_90 (checked by ``aot.py`` over all variants):

    - fp16/bf16, d <= 64: 64-key tiles, 4 warps (8 for 128 rows).
    - fp16/bf16, 64 < d <= 128: 16-32 rows: 32-key tiles, 4 warps; 64-128 rows: 64 keys, 8 warps.
    - 128-row tiles only on sm_90 (where they run as warpgroup MMA): sm_80's 128-row tile spills.
    - fp16/bf16, d = 256: 32 rows, 32-key tiles, 4 warps.
    - fp32: exact fp32 FMA dots (see test_triton_compile.py), 16 x 16 tiles, 4 warps.

    Which of the spill-free choices is fastest needs a GPU: ``bench/gpu.py``.
    """
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is not supported by the triton backend (1..{MAX_HEAD_DIM})")
    block_d = max(16, next_pow2(head_dim))
    rows = max(16, next_pow2(max_rows))
    if dtype == torch.float32:
        block_m, block_n, num_warps, num_stages = 16, 16, 4, 2
    elif block_d == 256:
        block_m, block_n, num_warps, num_stages = 32, 32, 4, 2
    else:
        block_m = min(rows, 128 if arch >= 90 else 64)
        if block_d <= 64:
            block_n, num_warps = 64, (8 if block_m == 128 else 4)
        elif block_m <= 32:
            block_n, num_warps = 32, 4
        else:
            block_n, num_warps = 64, 8
        num_stages = 3
    return TileConfig(block_m, block_n, block_d, num_warps, num_stages,
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


@dataclass
class WorkPartition:
    """Device int32 tables the kernels read, plus the launch sizes; built once per plan."""

    tiles: TileConfig
    requests: torch.Tensor  # [B, 8]: q_start, qo_len, kv_start|page_start, kv_len, tree_start, tree_size, splits,
    #                         part_start (first row of its split partials in the workspace)
    work: torch.Tensor  # [grid_work, 5]: request, first row, kv_lo, kv_hi, split (-1: not split)
    counts: torch.Tensor  # [2]: live work items, live tokens (programs past them exit)
    token_request: torch.Tensor  # [grid_tokens]: request of each query token
    tree_order: torch.Tensor
    page_indices: torch.Tensor
    o_part: torch.Tensor  # fp32 [partial rows, h_q, BLOCK_D] workspace for split chunks
    lse_part: torch.Tensor  # fp32 [partial rows, h_q]
    grid_work: int
    grid_tokens: int
    launch_merge: bool  # any split (always True in a graph envelope, whose contents change)
    chunk: int


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def partition_arrays(plan: TreeAttentionPlan, group: int, tiles: TileConfig, chunk: int) -> dict[str, np.ndarray]:
    """Host int32 tables for a given KV ``chunk`` (0: no split)."""
    qo, kv = plan.qo_lens.astype(np.int64), plan.kv_lens.astype(np.int64)
    batch = qo.shape[0]
    rowblocks = cdiv(qo * group, tiles.block_m)
    splits = np.where((kv > chunk) & (chunk > 0), cdiv(kv, max(chunk, 1)), 1)
    is_split = (splits > 1) & (qo > 0)
    part_rows = np.where(is_split, splits * qo, 0)
    part_start = np.concatenate([[0], np.cumsum(part_rows)[:-1]]) if batch else np.zeros(0, np.int64)
    kv_starts = plan.kv_starts if plan.kind == "ragged" else plan.page_starts
    requests = np.stack([plan.q_starts, qo, kv_starts, kv, plan.tree_starts, plan.tree_sizes, splits, part_start],
                        axis=1) if batch else np.zeros((0, 8), np.int64)

    items = rowblocks * splits
    req = np.repeat(np.arange(batch), items)
    local = np.arange(req.shape[0]) - np.repeat(np.cumsum(items) - items, items)
    split_idx, block = local // rowblocks[req], local % rowblocks[req]
    kv_lo = np.where(is_split[req], split_idx * chunk, 0)
    kv_hi = np.where(is_split[req], np.minimum(kv_lo + chunk, kv[req]), kv[req])
    work = np.stack([req, block * tiles.block_m, kv_lo, kv_hi, np.where(is_split[req], split_idx, -1)], axis=1)
    return {
        "requests": requests.astype(np.int32),
        "work": work.astype(np.int32).reshape(-1, 5),
        "token_request": np.repeat(np.arange(batch), qo).astype(np.int32),
        "partial_rows": np.int64(part_rows.sum()),
        "any_split": np.bool_(is_split.any()),
    }


def max_rows_per_request(plan: TreeAttentionPlan, group: int) -> int:
    return int(plan.qo_lens.max()) * group if plan.batch_size else 1


def build_partition(plan: TreeAttentionPlan, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, kv_chunk: int | None = None, tiles: TileConfig | None = None) -> WorkPartition:
    """The work partition of ``plan`` for these head counts and dtype.

    ``kv_chunk`` overrides the split heuristic (0: never split; > 0: that chunk length, rounded
    up to a multiple of ``BLOCK_N``), mainly for tests; ``tiles`` overrides the tile choice.
    """
    group = num_q_heads // num_kv_heads
    device = plan.device
    if tiles is None:
        tiles = choose_tiles(dtype, head_dim, max_rows_per_request(plan, group), arch=device_arch(device),
                             interpret=device.type == "cpu")
    if kv_chunk is None:
        rowblocks = cdiv(plan.qo_lens.astype(np.int64) * group, tiles.block_m)
        chunk = split_chunk(rowblocks, plan.kv_lens.astype(np.int64), num_kv_heads, tiles.block_n, num_sms(device))
    else:
        chunk = cdiv(int(kv_chunk), tiles.block_n) * tiles.block_n
    host = partition_arrays(plan, group, tiles, chunk)
    to_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    parts = int(host["partial_rows"])
    return WorkPartition(
        tiles=tiles,
        requests=to_dev(host["requests"]),
        work=to_dev(host["work"]),
        counts=to_dev(np.array([host["work"].shape[0], host["token_request"].shape[0]], np.int32)),
        token_request=to_dev(host["token_request"]),
        tree_order=_non_empty(plan.tree_order, device),
        page_indices=_non_empty(plan.page_indices, device),
        o_part=torch.empty(parts, num_q_heads, tiles.block_d, dtype=torch.float32, device=device),
        lse_part=torch.empty(parts, num_q_heads, dtype=torch.float32, device=device),
        grid_work=host["work"].shape[0],
        grid_tokens=host["token_request"].shape[0],
        launch_merge=bool(host["any_split"]),
        chunk=chunk if host["any_split"] else 0,
    )


def _non_empty(index: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Kernels take a pointer even to an absent or empty index array; give them a real one."""
    return index if index is not None and index.numel() else torch.zeros(2, dtype=torch.int32, device=device)


def partition_key(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    return (num_q_heads, num_kv_heads, head_dim, dtype)


def get_partition(plan: TreeAttentionPlan, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> WorkPartition:
    """The cached partition of ``plan`` (built on first use; later layers reuse it)."""
    cache = plan.cache.setdefault("triton", {})
    key = partition_key(num_q_heads, num_kv_heads, head_dim, dtype)
    if key not in cache:
        cache[key] = build_partition(plan, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     dtype=dtype)
    return cache[key]


def prepare(plan: TreeAttentionPlan, *, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            kv_chunk: int | None = None) -> WorkPartition:
    """Build (or rebuild with a forced ``kv_chunk``) and cache the partition the next run will use."""
    part = build_partition(plan, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           dtype=dtype, kv_chunk=kv_chunk)
    plan.cache.setdefault("triton", {})[partition_key(num_q_heads, num_kv_heads, head_dim, dtype)] = part
    return part
