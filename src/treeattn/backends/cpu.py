"""Fast CPU backend: PyTorch's CPU flash-attention kernel on GQA-packed rows, plus an LSE merge.

Per request and KV head, the ``T`` query rows times the ``group`` query heads that read that KV
head are packed into one ``[h_kv, T * group, d]`` block, so each prefix key is streamed once for
all of them. The prefix (every key before the tree) is visible to every row: plain unmasked
attention, computed by ``aten::_scaled_dot_product_flash_attention_for_cpu`` (a tiled
online-softmax kernel: fp32 accumulation, MKL sgemm for fp32 and oneDNN AMX brgemm for bf16, both
cores, natural-log LSE). The tree (the last ``n`` keys) is a separate call with an additive
``[T * group, n]`` ancestor mask, and the partial results are merged by their LSEs, so no mask spans
a long prefix. A short prefix (<= 1024 keys) is instead attended in the same call as the tree, its
columns all-zero in the mask: one kernel pass is cheaper than two plus a merge at that size.

Long prefixes are attended in pieces of at most 4096 keys, so that a head's piece stays in cache
while every row block of that head streams it; all partial results are merged at the end. When a request
has too few (head, row-block) work items to keep every core busy (few KV heads, few rows), its prefix
instead runs as one batch of chunks. Ragged keys are read in place (the kernel takes any key stride;
copying them to a head-major layout first measured slower). Paged KV is gathered piece by piece, as
whole ``page_size x d`` slabs, into a ``[2, h_kv, keys, d]`` buffer kept on the plan (the kernel needs
a uniform key stride within a head).

fp16/bf16 partial results come out of the kernel rounded to the input dtype, so a merged output
carries one extra rounding of a partial result (well within the dtype's tolerance); merge weights,
the merge itself and the LSE are fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..plan import TreeAttentionPlan
from ..lse import EMPTY_LSE
from ..rope import RoPE
from ..tree import ancestor_mask

LOG2E = 1.0 / math.log(2.0)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

# Prefixes are attended in pieces of at most this many keys, so that a head's K and V piece stays in
# cache while each of the kernel's row blocks of that head streams it (measured 15-35% faster at 16k
# keys on an idle 2-core Sapphire Rapids). Not smaller: every piece is one more parallel region, and
# on a loaded machine each region waits for both threads to be scheduled.
_PREFIX_CHUNK = 4096
# Fewer (head, row-block) work items than this per thread: run the prefix as one batch of chunks of at
# least _MIN_CHUNK keys instead, so that every thread has work.
_MIN_ITEMS_PER_THREAD = 4
_MIN_CHUNK = 1024
# Prefixes up to this length are attended together with the tree, under one mask of at most
# rows x (_SHORT_PREFIX + n): a second kernel call and the merge cost more than the mask there.
_SHORT_PREFIX = 1024
# Kernel calls below this many FLOPs (about 0.3 ms on one core) run on the calling thread alone, as
# do the packing, gathers and merges around the calls. Every OpenMP parallel region ends in a barrier
# that needs all threads scheduled: on an idle machine that costs microseconds, but with more runnable
# threads than cores it was measured at ~12 ms per region (a 100k-element copy: 12 ms on 2 threads,
# 10 us on 1), which would dominate every small call.
_PARALLEL_FLOPS = 3e7


class _Job(NamedTuple):
    """One request with query rows, derived once per plan."""

    request: int
    q_start: int
    q_end: int
    kv_start: int  # where its keys start in the ragged k/v (0 for paged)
    kv_len: int
    mask_start: int  # keys before this are unmasked (the prefix, or 0 when a short prefix joins the mask)
    mask: torch.Tensor | None  # additive [1, 1, rows * group, kv_len - mask_start] in the input dtype
    segments: tuple[tuple[int, int], ...]  # unmasked pieces attended one after the other
    batched_chunks: int  # > 1: the prefix runs as one batch of this many chunks, to occupy every thread


def _q_block(rows: int) -> int:
    """The kernel's query-block size (``q_split_size`` in ATen's FlashAttentionKernel.cpp)."""
    return 256 if rows >= 768 else 64 if rows >= 192 else 32


def _batched_chunks(h_kv: int, rows: int, prefix: int, threads: int) -> int:
    """How many batched pieces to cut a prefix into so that every thread gets several work items."""
    items = h_kv * -(-rows // _q_block(rows))
    if threads == 1 or items >= _MIN_ITEMS_PER_THREAD * threads:
        return 1
    wanted = -(-_MIN_ITEMS_PER_THREAD * threads // items)
    return max(1, min(wanted, prefix // _MIN_CHUNK))


def _segments(prefix: int) -> tuple[tuple[int, int], ...]:
    """Cut a prefix into near-equal pieces of at most ``_PREFIX_CHUNK`` keys."""
    if prefix == 0:
        return ()
    count = -(-prefix // _PREFIX_CHUNK)
    size = -(-prefix // count)
    return tuple((s, min(s + size, prefix)) for s in range(0, prefix, size))


def _tree_mask(order: torch.Tensor, rows: int, group: int, prefix: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask of the packed rows (row ``t * group + j`` is node ``n - rows + t``) over ``prefix``
    fully visible keys followed by the tree keys."""
    n = order.shape[0]
    visible = ancestor_mask(order.cpu())[n - rows:].repeat_interleave(group, dim=0)
    mask = torch.zeros(visible.shape[0], prefix + n, dtype=dtype)
    mask[:, prefix:].masked_fill_(~visible, float("-inf"))
    return mask[None, None]


def _jobs(plan: TreeAttentionPlan, h_kv: int, group: int, dtype: torch.dtype, threads: int) -> list[_Job]:
    """Per-request work, derived once per plan (every layer of a step reuses it)."""
    key = ("cpu.jobs", h_kv, group, dtype, threads)
    jobs = plan.cache.get(key)
    if jobs is None:
        jobs = []
        kv_starts = plan.kv_starts.tolist() if plan.kv_starts is not None else [0] * plan.batch_size
        for b, (qs, qo, ks, kv, ts, n) in enumerate(zip(plan.q_starts.tolist(), plan.qo_lens.tolist(), kv_starts,
                                                        plan.kv_lens.tolist(), plan.tree_starts.tolist(),
                                                        plan.tree_sizes.tolist())):
            if qo == 0:
                continue
            prefix = kv - n
            # A short prefix joins the tree's mask: one kernel pass instead of two plus a merge.
            mask_start = 0 if n and prefix <= _SHORT_PREFIX else prefix
            mask = _tree_mask(plan.tree_order[ts:ts + n], qo, group, prefix - mask_start, dtype) if n else None
            chunks = _batched_chunks(h_kv, qo * group, mask_start, threads)
            jobs.append(_Job(b, qs, qs + qo, ks, kv, mask_start, mask,
                             _segments(mask_start) if chunks == 1 else (), chunks))
        plan.cache[key] = jobs
    return jobs


def _attend(qp: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sm_scale: float,
            threads: int):
    """Packed rows ``qp [1, h_kv, R, d]`` over ``k/v [B, h_kv, L, d]`` (any key stride, L > 0), called with
    torch set to one thread; a large call gets ``threads``.

    Returns ``(o [B, h_kv, R, d], lse [B, h_kv, R])``, the LSE in natural log.
    """
    if k.shape[0] != 1:
        qp = qp.expand(k.shape[0], -1, -1, -1)
    parallel = threads > 1 and 4.0 * k.shape[0] * k.shape[1] * qp.shape[2] * k.shape[2] * k.shape[3] >= _PARALLEL_FLOPS
    if not parallel:
        return _flash(qp, k, v, 0.0, False, attn_mask=mask, scale=sm_scale)
    torch.set_num_threads(threads)
    try:
        return _flash(qp, k, v, 0.0, False, attn_mask=mask, scale=sm_scale)
    finally:
        torch.set_num_threads(1)


def _batched_prefix(qp, k, v, chunks: int, sm_scale: float, threads: int) -> list:
    """Unmasked attention over a prefix ``k/v [h_kv, P, d]`` as one batch of ``chunks`` pieces (+ a remainder)."""
    prefix = k.shape[1]
    size = prefix // chunks
    split = chunks * size

    def batched(x):  # the first chunks * size keys as a batch of chunks, without a copy
        return x[:, :split].unflatten(1, (chunks, size)).transpose(0, 1)

    parts = [_attend(qp, batched(k), batched(v), None, sm_scale, threads)]
    if split < prefix:
        parts.append(_attend(qp, k[None, :, split:], v[None, :, split:], None, sm_scale, threads))
    return parts


def _write(parts: list, out_rows: torch.Tensor, lse_rows: torch.Tensor, h_kv: int) -> None:
    """Merge partial results ``(o [B, h_kv, R, d], lse_ln [B, h_kv, R])`` into ``out_rows [T, h_q, d]``."""
    rows, h_q, d = out_rows.shape
    group = h_q // h_kv
    out_view = out_rows.view(rows, h_kv, group, d)
    lse_view = lse_rows.view(rows, h_kv, group)

    def unpacked(x, *tail):  # packed [h_kv, rows * group, *tail] -> [rows, h_kv, group, *tail]
        return x.view(h_kv, rows, group, *tail).transpose(0, 1)

    if len(parts) == 1 and parts[0][0].shape[0] == 1:
        o, lse = parts[0]
        out_view.copy_(unpacked(o[0], d))
        torch.mul(unpacked(lse[0]), LOG2E, out=lse_view)
        return
    if len(parts) == 2 and parts[0][0].shape[0] == 1 and parts[1][0].shape[0] == 1:
        (o1, l1), (o2, l2) = parts  # the common case: prefix + tree
        weight = unpacked(torch.sigmoid(l2[0] - l1[0]), 1)  # share of part 2: e^l2 / (e^l1 + e^l2)
        o1, o2 = unpacked(o1[0], d), unpacked(o2[0], d)
        if out_rows.dtype == torch.float32:
            torch.lerp(o1, o2, weight, out=out_view)
        else:
            out_view.copy_(torch.lerp(o1.float(), o2.float(), weight))
        torch.mul(unpacked(torch.logaddexp(l1[0], l2[0])), LOG2E, out=lse_view)
        return
    o = torch.cat([p[0] for p in parts])  # [B, h_kv, R, d]
    lse = torch.cat([p[1] for p in parts])
    total = torch.logsumexp(lse, dim=0)
    merged = torch.einsum("bhr,bhrd->hrd", torch.exp(lse - total), o.float())
    out_view.copy_(unpacked(merged, d))
    torch.mul(unpacked(total), LOG2E, out=lse_view)


_Fetch = Callable[[_Job, int, int], tuple[torch.Tensor, torch.Tensor]]


def _run(q: torch.Tensor, h_kv: int, jobs: list[_Job], fetch: _Fetch, sm_scale: float, out, lse,
         threads: int) -> None:
    """Attend every job; ``fetch(job, start, end)`` returns its keys/values ``[h_kv, end - start, d]``.
    Everything but large kernel calls runs on this thread (see ``_PARALLEL_FLOPS``)."""
    torch.set_num_threads(1)
    try:
        _run_jobs(q, h_kv, jobs, fetch, sm_scale, out, lse, threads)
    finally:
        torch.set_num_threads(threads)


def _run_jobs(q, h_kv: int, jobs: list[_Job], fetch: _Fetch, sm_scale: float, out, lse, threads: int) -> None:
    d = q.shape[2]
    for job in jobs:
        qs, qe = job.q_start, job.q_end
        if job.kv_len == 0:  # no keys at all
            out[qs:qe].zero_()
            lse[qs:qe].fill_(EMPTY_LSE)
            continue
        rows = qe - qs
        qp = q[qs:qe].view(rows, h_kv, -1, d).transpose(0, 1).reshape(1, h_kv, -1, d)
        parts = []
        if job.batched_chunks > 1:
            parts += _batched_prefix(qp, *fetch(job, 0, job.mask_start), job.batched_chunks, sm_scale, threads)
        for start, end in job.segments:
            k, v = fetch(job, start, end)
            parts.append(_attend(qp, k[None], v[None], None, sm_scale, threads))
        if job.mask is not None:
            k, v = fetch(job, job.mask_start, job.kv_len)
            parts.append(_attend(qp, k[None], v[None], job.mask, sm_scale, threads))
        _write(parts, out[qs:qe], lse[qs:qe], h_kv)


def tree_attention(q, k, v, plan: TreeAttentionPlan, *, sm_scale: float, rope: RoPE | None,
                   q_positions, k_positions, out: torch.Tensor, lse: torch.Tensor) -> None:
    if rope is not None:  # rounds to the dtype after rotating, as TVM's kernels do
        q = rope.apply(q, q_positions)
        k = rope.apply(k, k_positions)
    h_kv = k.shape[1]
    keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [h_kv, Lkv, d] views: the kernel reads them in place

    def fetch(job: _Job, start: int, end: int):
        return keys[:, job.kv_start + start:job.kv_start + end], values[:, job.kv_start + start:job.kv_start + end]

    threads = torch.get_num_threads()
    _run(q, h_kv, _jobs(plan, h_kv, q.shape[1] // h_kv, q.dtype, threads), fetch, sm_scale, out, lse, threads)


def _page_rows(plan: TreeAttentionPlan, h_kv: int) -> list[torch.Tensor]:
    """Per request, ``[2, h_kv, pages]``: the rows of ``kv_pages.view(-1, page_size * d)`` holding each
    page's K (0) and V (1) slab of each head."""
    key = ("cpu.page_rows", h_kv)
    rows = plan.cache.get(key)
    if rows is None:
        ids = torch.from_numpy(plan.page_indices_host)
        slab = torch.arange(2)[:, None, None] * h_kv + torch.arange(h_kv)[None, :, None]  # (K/V s, head h)
        rows = [ids[start:start + count][None, None, :] * (2 * h_kv) + slab  # row (p * 2 + s) * h_kv + h
                for start, count in zip(plan.page_starts.tolist(), plan.num_pages.tolist())]
        plan.cache[key] = rows
    return rows


def _workspace(plan: TreeAttentionPlan, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A gather buffer kept on the plan and reused by every call of the step: a fresh multi-MB allocation
    per call costs more in page faults than the gather itself. (So one plan must not run in two threads
    at once.)"""
    key = ("cpu.workspace", width, dtype)
    buf = plan.cache.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = torch.empty(rows, width, dtype=dtype)
        plan.cache[key] = buf
    return buf


def paged_tree_attention(q, kv_pages, plan: TreeAttentionPlan, *, sm_scale: float, out: torch.Tensor,
                         lse: torch.Tensor) -> None:
    _, _, h_kv, page_size, d = kv_pages.shape
    page_rows = _page_rows(plan, h_kv)
    slabs = kv_pages.view(-1, page_size * d)

    def fetch(job: _Job, start: int, end: int):
        # Gather the pages covering [start, end) as whole [page_size, d] slabs into [2, h_kv, keys, d]:
        # contiguous keys per head, and small enough to stay in cache while the kernel reads them.
        first, last = start // page_size, -(-end // page_size)
        rows = page_rows[job.request][:, :, first:last].reshape(-1)
        buf = _workspace(plan, rows.shape[0], slabs.shape[1], q.dtype)[:rows.shape[0]]
        torch.index_select(slabs, 0, rows, out=buf)
        kv = buf.view(2, h_kv, -1, d)[:, :, start - first * page_size:end - first * page_size]
        return kv[0], kv[1]

    threads = torch.get_num_threads()
    _run(q, h_kv, _jobs(plan, h_kv, q.shape[1] // h_kv, q.dtype, threads), fetch, sm_scale, out, lse, threads)


def merge_state(out_a, lse_a, out_b, lse_b, *, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Base-2 LSE merge in fp32; ``out``/``lse`` may alias ``out_a``/``lse_a``."""
    weight_b = torch.sigmoid((lse_b - lse_a) * math.log(2.0))  # 2^lb / (2^la + 2^lb)
    merged = torch.lerp(out_a.float(), out_b.float(), weight_b[..., None])
    out.copy_(merged)
    torch.logaddexp2(lse_a, lse_b, out=lse)
