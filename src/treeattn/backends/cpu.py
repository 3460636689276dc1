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
a uniform key stride within a head), from any page layout through ``treeattn.layout.PagedKV``, into a
per-thread ``[h_kv, keys, d]`` buffer per tensor (so a plan can be shared by threads).

A key a row cannot see must not reach it: the additive mask gives ``NaN + -inf = NaN`` for a NaN
key, so a tree block whose keys or values are not all finite (checked per call: the tree is small)
runs through the reference's exact masked formula in fp32 instead.

fp16/bf16 partial results come out of the kernel rounded to the input dtype, so a merged output
carries one extra rounding of a partial result (well within the dtype's tolerance); merge weights,
the merge itself and the LSE are fp32.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..layout import PagedKV
from ..lse import EMPTY_LSE, LOG2E, merge
from ..plan import TreeAttentionPlan
from ..tree import ancestor_mask
from .base import AttentionSpec, Backend
from .reference import masked_attention

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
    """One request with query rows, derived once per plan. Key ranges are request-relative."""

    request: int
    q_start: int
    q_end: int
    kv_start: int  # where its keys start in the ragged k/v (0 for paged)
    kv_len: int
    unmasked: tuple[int, int]  # keys every row sees: attended without a mask (maybe in pieces)
    masked: tuple[tuple[int, int], ...]  # key ranges attended together under ``mask`` (concatenated)
    mask: torch.Tensor | None  # additive [1, 1, rows * group, keys in ``masked``] in the input dtype
    tree_size: int  # the last tree_size keys of the masked block are the tree (the keys some rows cannot see)
    segments: tuple[tuple[int, int], ...]  # pieces of ``unmasked`` attended one after the other
    batched_chunks: int  # > 1: ``unmasked`` runs as one batch of this many chunks, to occupy every thread


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


def _segments(start: int, end: int) -> tuple[tuple[int, int], ...]:
    """Cut ``[start, end)`` into near-equal pieces of at most ``_PREFIX_CHUNK`` keys."""
    if end <= start:
        return ()
    count = -(-(end - start) // _PREFIX_CHUNK)
    size = -(-(end - start) // count)
    return tuple((s, min(s + size, end)) for s in range(start, end, size))


def _job(plan: TreeAttentionPlan, b: int, h_kv: int, group: int, dtype: torch.dtype, threads: int,
         window: int | None) -> _Job:
    """Request ``b``'s work: which keys every row sees (no mask), which need a mask, which are skipped.

    Without a window the prefix is the unmasked part and the tree the masked one. With a window a row
    at position ``p`` sees prefix keys from ``p - window + 1``: keys below every row's window are never
    read, keys inside every row's window need no mask, and the few in between (as many as the tree is
    deep) join the tree's masked block.
    """
    qs, qo, kv, n = (int(x[b]) for x in (plan.q_starts, plan.qo_lens, plan.kv_lens, plan.tree_sizes))
    ks = int(plan.kv_starts[b]) if plan.kv_starts is not None else 0
    prefix = kv - n
    lo_min = lo_max = 0
    if window is not None:
        row_pos, key_pos = plan.positions(b)
        lo = np.clip(row_pos - window + 1, 0, prefix)
        lo_min, lo_max = int(lo.min()), int(lo.max())
    if n == 0 and lo_min == lo_max:  # every row sees the same keys: no mask at all
        masked, unmasked = (), (lo_min, kv)
    elif prefix - lo_max <= _SHORT_PREFIX:  # a short unmasked part joins the mask: one kernel pass, no merge
        masked, unmasked = ((lo_min, kv),), (lo_max, lo_max)
    else:
        masked, unmasked = tuple(r for r in ((lo_min, lo_max), (prefix, kv)) if r[1] > r[0]), (lo_max, prefix)
    mask = None
    if masked:
        cols = torch.cat([torch.arange(a, e) for a, e in masked])
        visible = torch.ones(qo, cols.shape[0], dtype=torch.bool)
        if n:
            start = int(plan.tree_starts[b])
            tree = ancestor_mask(plan.tree_order[start:start + n].cpu())[n - qo:]
            in_tree = cols >= prefix
            visible[:, in_tree] = tree[:, cols[in_tree] - prefix]
        if window is not None:
            visible &= torch.from_numpy(key_pos)[cols][None, :] > torch.from_numpy(row_pos)[:, None] - window
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
        mask = mask.repeat_interleave(group, dim=0)[None, None]  # packed row t * group + j is token t
    chunks = _batched_chunks(h_kv, qo * group, unmasked[1] - unmasked[0], threads)
    segments = _segments(*unmasked) if chunks == 1 else ()
    return _Job(b, qs, qs + qo, ks, kv, unmasked, masked, mask, n, segments, chunks)


@dataclass
class CpuPlan:
    """What the CPU backend derives from a plan, once: the jobs (per torch thread count, which decides
    how a prefix is split) and, for paged plans, each request's page ids as a tensor."""

    plan: TreeAttentionPlan
    spec: AttentionSpec
    page_ids: list[torch.Tensor] | None
    _jobs: dict[int, list[_Job]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def jobs(self, threads: int) -> list[_Job]:
        jobs = self._jobs.get(threads)
        if jobs is None:
            with self._lock:
                jobs = self._jobs.get(threads)
                if jobs is None:
                    spec = self.spec
                    jobs = [_job(self.plan, b, spec.num_kv_heads, spec.group, spec.dtype, threads, spec.sliding_window)
                            for b in range(self.plan.batch_size) if self.plan.qo_lens[b]]
                    self._jobs[threads] = jobs
        return jobs


def _attend(qp: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sm_scale: float,
            threads: int, softcap: float | None = None):
    """Packed rows ``qp [1, h_kv, R, d]`` over ``k [B, h_kv, L, d]``, ``v [B, h_kv, L, d_v]`` (any key stride,
    L > 0), called with torch set to one thread; a large call gets ``threads``.

    Returns ``(o [B, h_kv, R, d_v], lse [B, h_kv, R])``, the LSE in natural log.
    """
    if k.shape[0] != 1:
        qp = qp.expand(k.shape[0], -1, -1, -1)
    d_v = v.shape[-1]
    if d_v < k.shape[-1] and v.data_ptr() == k.data_ptr() and v.stride() == k.stride():
        v = k  # MLA: V is K's first d_v dims, so P @ K holds P @ V in its first d_v dims (and flash can run)
    # The flash kernel has no soft-cap and needs one head dim for q, k and v.
    kernel = _flash if softcap is None and k.shape[-1] == v.shape[-1] else functools.partial(_explicit, softcap=softcap)
    parallel = threads > 1 and 4.0 * k.shape[0] * k.shape[1] * qp.shape[2] * k.shape[2] * k.shape[3] >= _PARALLEL_FLOPS
    if parallel:
        torch.set_num_threads(threads)
    try:
        o, lse = kernel(qp, k, v, 0.0, False, attn_mask=mask, scale=sm_scale)
    finally:
        if parallel:
            torch.set_num_threads(1)
    return o[..., :d_v], lse


def _explicit(qp, k, v, dropout_p, is_causal, *, attn_mask, scale, softcap):
    """The flash kernel's contract with the scores held explicitly (fp32 matmuls): for soft-capping and a
    value head dim of its own. Pieces are at most ``_PREFIX_CHUNK`` keys, so the scores stay small."""
    scores = torch.matmul(qp.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attn_mask is not None:
        scores = scores + attn_mask
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(qp.dtype), lse


def _batched_prefix(qp, k, v, chunks: int, sm_scale: float, threads: int, softcap: float | None) -> list:
    """Unmasked attention over a prefix ``k/v [h_kv, P, d]`` as one batch of ``chunks`` pieces (+ a remainder)."""
    prefix = k.shape[1]
    size = prefix // chunks
    split = chunks * size

    def batched(x):  # the first chunks * size keys as a batch of chunks, without a copy
        return x[:, :split].unflatten(1, (chunks, size)).transpose(0, 1)

    parts = [_attend(qp, batched(k), batched(v), None, sm_scale, threads, softcap)]
    if split < prefix:
        parts.append(_attend(qp, k[None, :, split:], v[None, :, split:], None, sm_scale, threads, softcap))
    return parts


def _write(parts: list, out_rows: torch.Tensor, lse_rows: torch.Tensor, h_kv: int) -> None:
    """Merge partial results ``(o [B, h_kv, R, d], lse_ln [B, h_kv, R])`` into ``out_rows [T, h_q, d]``."""
    rows, h_q, d = out_rows.shape  # d: the value head dim
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


class _Step(NamedTuple):
    """A call's values: what every job of it shares."""

    sm_scale: float
    softcap: float | None
    sinks: torch.Tensor | None  # float32 [h_q], natural log
    threads: int


def _run(q: torch.Tensor, h_kv: int, jobs: list[_Job], fetch: _Fetch, step: _Step, out, lse) -> None:
    """Attend every job; ``fetch(job, start, end)`` returns its keys/values ``[h_kv, end - start, d]``.
    Everything but large kernel calls runs on this thread (see ``_PARALLEL_FLOPS``)."""
    torch.set_num_threads(1)
    try:
        for job in jobs:
            _run_job(q, h_kv, job, fetch, step, out[job.q_start:job.q_end], lse[job.q_start:job.q_end])
    finally:
        torch.set_num_threads(step.threads)


def _run_job(q, h_kv: int, job: _Job, fetch: _Fetch, step: _Step, out_rows, lse_rows) -> None:
    sm_scale, softcap, threads = step.sm_scale, step.softcap, step.threads
    rows = job.q_end - job.q_start
    qp = q[job.q_start:job.q_end].view(rows, h_kv, -1, q.shape[2]).transpose(0, 1).reshape(1, h_kv, -1, q.shape[2])
    parts = []
    if job.batched_chunks > 1:
        parts += _batched_prefix(qp, *fetch(job, *job.unmasked), job.batched_chunks, sm_scale, threads, softcap)
    for start, end in job.segments:
        k, v = fetch(job, start, end)
        parts.append(_attend(qp, k[None], v[None], None, sm_scale, threads, softcap))
    if job.mask is not None:
        k, v = fetch(job, *job.masked[-1])
        if len(job.masked) == 2:  # window edge + tree: a few keys each, concatenated (fetches reuse a buffer)
            k_edge, v_edge = fetch(job, *job.masked[0])
            k, v = torch.cat([k_edge, k], dim=1), torch.cat([v_edge, v], dim=1)
        tree = slice(k.shape[1] - job.tree_size, None)  # the keys some rows cannot see
        # One reduction: the sum is finite iff every value is (an overflowing sum only costs the exact path).
        if bool(torch.isfinite(k[:, tree].sum(dtype=torch.float32) + v[:, tree].sum(dtype=torch.float32))):
            parts.append(_attend(qp, k[None], v[None], job.mask, sm_scale, threads, softcap))
        else:
            parts.append(_exact_masked(q[job.q_start:job.q_end], k, v, job.mask, sm_scale, softcap))
    if parts:
        _write(parts, out_rows, lse_rows, h_kv)
    else:  # no keys at all
        out_rows.zero_()
        lse_rows.fill_(EMPTY_LSE)
    if step.sinks is not None:  # the sink is one more part: a key of value 0 with logit sink
        sink_lse = (step.sinks * LOG2E).expand_as(lse_rows)
        total = torch.where(lse_rows == EMPTY_LSE, sink_lse, torch.logaddexp2(lse_rows, sink_lse))
        out_rows.mul_(torch.exp2(lse_rows - total).unsqueeze(-1).to(out_rows.dtype))
        lse_rows.copy_(total)


def _exact_masked(q_rows, k, v, mask, sm_scale: float, softcap: float | None):
    """The masked block through the reference formula in fp32 (keys a row cannot see are left out, so
    non-finite values there cannot reach it), returned packed like a kernel part."""
    h_kv, group = k.shape[0], q_rows.shape[1] // k.shape[0]
    visible = mask[0, 0, ::group] == 0  # packed row t * group + j belongs to token t
    o, lse2 = masked_attention(q_rows.float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), visible, sm_scale,
                               softcap)
    rows = q_rows.shape[0]
    o = o.to(q_rows.dtype).view(rows, h_kv, group, -1).transpose(0, 1).reshape(1, h_kv, rows * group, -1)
    lse_ln = (lse2 / LOG2E).view(rows, h_kv, group).transpose(0, 1).reshape(1, h_kv, rows * group)
    return o, lse_ln


class CpuBackend(Backend):
    """PyTorch's CPU flash kernel on GQA-packed rows (see the module docstring)."""

    name = "cpu"

    def __init__(self):
        # Gather buffers for paged KV, one per thread: a fresh multi-MB allocation per call costs more in
        # page faults than the gather itself, and a buffer shared through the plan would race.
        self._scratch = threading.local()

    def unsupported(self, spec: AttentionSpec) -> str | None:
        if spec.device.type != "cpu":
            return f"needs CPU tensors, got tensors on {spec.device}"
        return None

    def plan(self, plan: TreeAttentionPlan, spec: AttentionSpec) -> CpuPlan:
        page_ids = None
        if plan.kind == "paged":
            ids = torch.from_numpy(plan.page_indices_host)
            page_ids = [ids[start:start + count] for start, count in
                        zip(plan.page_starts.tolist(), plan.num_pages.tolist())]
        return CpuPlan(plan, spec, page_ids)

    def tree_attention(self, q, k, v, plan, state: CpuPlan, *, sm_scale, out, lse, sinks=None) -> None:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [h_kv, Lkv, d] views: the kernel reads them in place

        def fetch(job: _Job, start: int, end: int):
            return keys[:, job.kv_start + start:job.kv_start + end], values[:, job.kv_start + start:job.kv_start + end]

        step = _Step(sm_scale, state.spec.logit_softcap, sinks, torch.get_num_threads())
        _run(q, k.shape[1], state.jobs(step.threads), fetch, step, out, lse)

    def _buffer(self, elements: int, dtype: torch.dtype) -> torch.Tensor:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.dtype != dtype or buf.numel() < elements:
            with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
                buf = torch.empty(elements, dtype=dtype)
            self._scratch.buf = buf
        return buf[:elements]

    def paged_tree_attention(self, q, kv: PagedKV, plan, state: CpuPlan, *, sm_scale, out, lse, sinks=None) -> None:
        page_size, h_kv, shared = kv.page_size, kv.num_kv_heads, kv.shares_storage()

        def fetch(job: _Job, start: int, end: int):
            # Gather the pages covering [start, end) into [h_kv, keys, d] per tensor: one key stride per
            # head, and small enough to stay in cache while the kernel reads them.
            first, last = start // page_size, -(-end // page_size)
            ids = state.page_ids[job.request][first:last]
            size = h_kv * ids.shape[0] * page_size * kv.head_dim
            lo, hi = start - first * page_size, end - first * page_size
            if shared:  # MLA: gather the latent once; V is a view of its first dims
                k = PagedKV.gather_heads(kv.k, ids, self._buffer(size, q.dtype))[:, lo:hi]
                return k, k[..., :kv.v_head_dim]
            buf = self._buffer(size + h_kv * ids.shape[0] * page_size * kv.v_head_dim, q.dtype)
            k = PagedKV.gather_heads(kv.k, ids, buf[:size])
            v = PagedKV.gather_heads(kv.v, ids, buf[size:])
            return k[:, lo:hi], v[:, lo:hi]

        step = _Step(sm_scale, state.spec.logit_softcap, sinks, torch.get_num_threads())
        _run(q, h_kv, state.jobs(step.threads), fetch, step, out, lse)

    def merge_state(self, out_a, lse_a, out_b, lse_b, *, out, lse) -> None:
        merged, merged_lse = merge(out_a, lse_a, out_b, lse_b, torch.float32)
        out.copy_(merged)
        lse.copy_(merged_lse)
