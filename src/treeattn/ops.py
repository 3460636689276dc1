"""Public operators: check every argument, plan the batch, pick a backend by capability, run it.

Every call goes the same way, from users and from the KV cache alike: validate the tensors, take
the ``TreeAttentionPlan`` (built here when none is given), describe the call as an
``AttentionSpec``, let ``backends.select`` pick the backend that can run it, fetch that backend's
per-step state from the plan (built once per step), then run.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from .backends import AttentionSpec, select
from .layout import PagedKV
from .plan import TreeAttentionPlan, check_index_tensor
from .rope import RoPE

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_float(x, name: str, ndim: int, dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
    """A float16/bfloat16/float32 tensor of ``ndim`` dims with a contiguous last dimension."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} has dtype {x.dtype}, expected {dtype} (the dtype of q)")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (all inputs of one call on one device)")
    if x.numel() and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {x.stride()}")


def check_heads(h_q: int, h_kv: int, d_q: int, d_kv: int, kv_name: str) -> None:
    """GQA grouping and matching query/key head dims."""
    if h_q == 0:
        raise ValueError("q has 0 heads; it needs at least one query head")
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"q has {h_q} heads, which must be a multiple of {kv_name}'s {h_kv} KV heads (GQA groups)")
    if d_q == 0:
        raise ValueError("head dim must be positive")
    if d_q != d_kv:
        raise ValueError(f"q has head dim {d_q} but {kv_name} has head dim {d_kv}")


def resolve_sm_scale(sm_scale, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, (bool, torch.Tensor)) or not isinstance(sm_scale, Real):  # numpy scalars are Real
        raise TypeError(f"sm_scale must be a real number, got {type(sm_scale).__name__}")
    sm_scale = float(sm_scale)
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be finite and > 0, got {sm_scale}")
    return sm_scale


def _outputs(rows: int, heads: int, dim: int, like: torch.Tensor, out, lse) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        out = torch.empty(rows, heads, dim, dtype=like.dtype, device=like.device)
    else:
        check_float(out, "out", 3, like.dtype, like.device)
        if tuple(out.shape) != (rows, heads, dim) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous tensor of shape {(rows, heads, dim)}, got {tuple(out.shape)}")
    if lse is None:
        lse = torch.empty(rows, heads, dtype=torch.float32, device=like.device)
    else:
        if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32:
            raise TypeError(f"lse must be a float32 tensor, got {getattr(lse, 'dtype', type(lse).__name__)}")
        if lse.device != like.device:
            raise ValueError(f"lse is on {lse.device}, expected {like.device}")
        if tuple(lse.shape) != (rows, heads) or not lse.is_contiguous():
            raise ValueError(f"lse must be a contiguous tensor of shape {(rows, heads)}, got {tuple(lse.shape)}")
    return out, lse


def _check_positions(pos, name: str, length: int, device: torch.device) -> torch.Tensor:
    pos = check_index_tensor(pos, name, device=device)
    if pos.shape[0] != length:
        raise ValueError(f"{name} must have shape [{length}], got {tuple(pos.shape)}")
    if pos.numel() and int(pos.min()) < 0:
        raise ValueError(f"{name} must be non-negative")
    return pos


def check_variants(sliding_window, logit_softcap, sinks, num_q_heads: int, device: torch.device) -> torch.Tensor | None:
    """The attention variants' values (see ``tree_attention``); returns ``sinks`` as float32 on ``device``."""
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, Integral):
            raise TypeError(f"sliding_window must be an int or None, got {type(sliding_window).__name__}")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (keys a row sees, itself included), got {sliding_window}")
    if logit_softcap is not None:
        if isinstance(logit_softcap, (bool, torch.Tensor)) or not isinstance(logit_softcap, Real):
            raise TypeError(f"logit_softcap must be a real number or None, got {type(logit_softcap).__name__}")
        if not math.isfinite(logit_softcap) or logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be finite and > 0, got {logit_softcap}")
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32:
        raise TypeError(f"sinks must be a float32 tensor [h_q] of natural-log logits, got "
                        f"{getattr(sinks, 'dtype', type(sinks).__name__)}")
    if tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"sinks must have shape [{num_q_heads}] (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device}, expected {device} (all inputs of one call on one device)")
    if sinks.numel() and not bool(torch.isfinite(sinks).all()):
        raise ValueError("sinks must be finite")
    return sinks


def _variant_spec(sliding_window, logit_softcap, sinks) -> dict:
    return {"sliding_window": None if sliding_window is None else int(sliding_window),
            "logit_softcap": None if logit_softcap is None else float(logit_softcap), "sinks": sinks is not None}


def _check_plan(plan, kind: str) -> None:
    if not isinstance(plan, TreeAttentionPlan) or plan.kind != kind:
        raise TypeError(f"plan must be a TreeAttentionPlan built with TreeAttentionPlan.{kind}(...)")


def prepare_plan(plan: TreeAttentionPlan, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, v_head_dim: int | None = None, backend=None) -> TreeAttentionPlan:
    """Do the chosen backend's per-step host work for ``plan`` now (work partition, device tables) rather
    than in the first layer's call, as FlashInfer's ``plan()`` does; every later call of the step only
    runs. Returns ``plan``. (Here, not on the plan: choosing a backend is the operators' job, and the plan
    sits below the backends that read it.)"""
    spec = AttentionSpec(plan.device, dtype, num_q_heads, num_kv_heads, head_dim,
                         head_dim if v_head_dim is None else v_head_dim, page_size=plan.page_size)
    plan.state(select(backend, spec), spec)
    return plan


def tree_attention(q, q_indptr, k, v, kv_indptr, tree_indptr, tree_order, *, sm_scale=None, rope=None,
                   q_positions=None, k_positions=None, sliding_window=None, logit_softcap=None, sinks=None,
                   out=None, lse=None, backend=None, plan=None):
    """Tree attention over ragged keys/values (TVM ``tree_attn``). Returns ``(out, lse)``.

    ``q [Lq, h_q, d]``, ``k``/``v [Lkv, h_kv, d]``; request ``b``'s query rows are
    ``q[q_indptr[b]:q_indptr[b+1]]`` and its keys ``k[kv_indptr[b]:kv_indptr[b+1]]``; its tree
    (``tree_order[tree_indptr[b]:tree_indptr[b+1]]``) is the last keys, its queries the last nodes.
    Each row sees the whole prefix plus its ancestors. ``lse`` is base 2 of the scaled scores.
    With ``rope``, q and k are rotated at ``q_positions``/``k_positions`` first.
    ``plan`` (from ``TreeAttentionPlan.ragged``) skips re-checking the index arrays; arrays passed
    with it must be the ones it was built from, or ``None``.

    Variants (each composes with the others): ``sliding_window=W`` (HF's meaning) lets a row at
    position ``p`` see only keys at positions ``> p - W``, where prefix key ``j`` is at ``j`` and tree
    node ``i`` at ``prefix_len + depth(i)`` (a row is at its node's position; without a tree, at the
    last key's); ``logit_softcap=c`` turns scores into ``c * tanh(score / c)`` after ``sm_scale``
    (Gemma 2), and the LSE is of the capped scores; ``sinks`` (float32 ``[h_q]``, natural-log logits,
    GPT-OSS) adds one logit per query head to every softmax denominator, as a key whose value is 0:
    ``out`` and ``lse`` then include it (a row with no keys gets ``out = 0``, ``lse = sink / ln 2``),
    so a result with sinks merges exactly with partial results without them: pass sinks to one part
    of a split computation only. ``v`` may have another head dim than ``q``/``k`` (``out`` takes v's),
    e.g. MLA's absorbed form (``h_kv = 1``, ``v`` a view of ``k[..., :d_v]``).
    """
    check_float(q, "q", 3)
    check_float(k, "k", 3, q.dtype, q.device)
    check_float(v, "v", 3, q.dtype, q.device)
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same [keys, heads], got {tuple(k.shape)} and {tuple(v.shape)}")
    if v.numel() and not torch.compiler.is_compiling() and v.data_ptr() == k.data_ptr() and v.shape[2] > k.shape[2]:
        raise ValueError(f"v starts where k does (a view of it, as MLA's latent) but has head dim {v.shape[2]} > "
                         f"k's {k.shape[2]}: a view of k can only take k's first dims")
    check_heads(q.shape[1], k.shape[1], q.shape[2], k.shape[2], "k")
    if plan is None:
        plan = TreeAttentionPlan.ragged(q_indptr, kv_indptr, tree_indptr, tree_order,
                                        total_q=q.shape[0], total_kv=k.shape[0], device=q.device)
    else:
        _check_plan(plan, "ragged")
        if plan.device != q.device or plan.total_q != q.shape[0] or plan.total_kv != k.shape[0]:
            raise ValueError("plan was built for a different batch: its lengths or device do not match q/k")
        plan.check_inputs(q_indptr=q_indptr, kv_indptr=kv_indptr, tree_indptr=tree_indptr, tree_order=tree_order)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[2])
    if rope is not None:
        if not isinstance(rope, RoPE):
            raise TypeError(f"rope must be a treeattn.RoPE, got {type(rope).__name__}")
        if q.shape[2] % 2:
            raise ValueError(f"rope needs an even head dim, got {q.shape[2]}")
        if q_positions is None:
            raise ValueError("rope needs q_positions (the RoPE position of every query row, [Lq] int32)")
        q_positions = _check_positions(q_positions, "q_positions", q.shape[0], q.device)
        if k_positions is None:
            if not plan.same_q_and_kv_layout():
                raise ValueError("k_positions is required with rope unless kv_indptr == q_indptr "
                                 "(k_positions defaults to q_positions, as in TVM)")
            k_positions = q_positions
        else:
            k_positions = _check_positions(k_positions, "k_positions", k.shape[0], q.device)
    elif q_positions is not None or k_positions is not None:
        raise ValueError("q_positions/k_positions are only used with rope; pass rope=treeattn.RoPE(...)")
    sinks = check_variants(sliding_window, logit_softcap, sinks, q.shape[1], q.device)
    spec = AttentionSpec(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], v.shape[2], rope=rope is not None,
                         **_variant_spec(sliding_window, logit_softcap, sinks))
    chosen = select(backend, spec)
    state = plan.state(chosen, spec)
    out, lse = _outputs(q.shape[0], q.shape[1], v.shape[2], q, out, lse)
    if rope is not None:  # TVM's inline RoPE: rotate, round to the dtype, then attend
        q, k = chosen.rope(rope, q, q_positions), chosen.rope(rope, k, k_positions)
    chosen.tree_attention(q, k, v, plan, state, sm_scale=sm_scale, out=out, lse=lse, sinks=sinks)
    return out, lse


def paged_tree_attention(q, q_indptr, kv_pages, page_indptr, page_indices, last_page_len, tree_indptr,
                         tree_order, *, kv_layout=None, sm_scale=None, sliding_window=None, logit_softcap=None,
                         sinks=None, out=None, lse=None, backend=None, plan=None):
    """Tree attention over a paged KV cache (TVM ``tree_attn_with_paged_kv_cache``). Returns ``(out, lse)``.

    ``kv_pages`` is TVM's combined ``[num_pages, 2, h_kv, page_size, d]`` tensor (0 = K, 1 = V), or a
    ``(k_pages, v_pages)`` pair in ``kv_layout`` ``"NHD"`` (each ``[num_pages, page_size, h_kv, d]``,
    the default for a pair) or ``"HND"`` (``[num_pages, h_kv, page_size, d]``), read in place with
    any strides (views into a bigger engine tensor are fine; see ``treeattn.layout``). Request ``b``
    owns pages ``page_indices[page_indptr[b]:page_indptr[b+1]]`` in order, the last one filled to
    ``last_page_len[b]``. Same masking, variants and outputs as ``tree_attention`` (MLA: ``v_pages`` a
    view of ``k_pages[..., :d_v]``).
    """
    kv = PagedKV.wrap(kv_pages, kv_layout)
    call = prepare_paged_tree_attention(q, kv, q_indptr, page_indptr, page_indices, last_page_len, tree_indptr,
                                        tree_order, sm_scale=sm_scale, sliding_window=sliding_window,
                                        logit_softcap=logit_softcap, sinks=sinks, backend=backend, plan=plan)
    return call.run(q, kv, out=out, lse=lse)


class PagedCall:
    """One step's paged tree attention, checked, planned and dispatched once, then run for many layers
    (FlashInfer's plan/run): ``run(q, kv)`` checks only that ``q`` and the pages look like those it was
    prepared for (shape, dtype, device, layout), then makes the backend's call. Built by
    ``prepare_paged_tree_attention``; ``paged_tree_attention`` is one prepare and one run."""

    def __init__(self, backend, state, plan: TreeAttentionPlan, sm_scale: float, sinks, q, kv: PagedKV):
        self.backend, self.state, self.plan, self.sm_scale, self.sinks = backend, state, plan, sm_scale, sinks
        self._q = (tuple(q.shape), q.dtype, q.device)
        self._kv = _kv_signature(kv)

    def run(self, q, kv: PagedKV, *, out=None, lse=None) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(q, torch.Tensor) or (tuple(q.shape), q.dtype, q.device) != self._q:
            raise ValueError(f"q must be a {self._q[1]} tensor of shape {self._q[0]} on {self._q[2]}, as prepared; "
                             f"got {getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
        if not isinstance(kv, PagedKV) or _kv_signature(kv) != self._kv:
            raise ValueError("the pages must have the layout, shapes, dtype and device this call was prepared for")
        out, lse = _outputs(q.shape[0], q.shape[1], kv.v_head_dim, q, out, lse)
        self.backend.paged_tree_attention(q, kv, self.plan, self.state, sm_scale=self.sm_scale, out=out, lse=lse,
                                          sinks=self.sinks)
        return out, lse


def _kv_signature(kv: PagedKV) -> tuple:
    return kv.layout, tuple(kv.k.shape), tuple(kv.v.shape), kv.k.stride(), kv.v.stride(), kv.dtype, kv.device


def prepare_paged_tree_attention(q, kv: PagedKV, q_indptr=None, page_indptr=None, page_indices=None,
                                 last_page_len=None, tree_indptr=None, tree_order=None, *, sm_scale=None,
                                 sliding_window=None, logit_softcap=None, sinks=None, backend=None,
                                 plan=None) -> PagedCall:
    """Every check, the plan and the backend choice of ``paged_tree_attention``, done once: the returned
    ``PagedCall`` runs the call for any number of layers whose ``q`` and pages (a ``PagedKV``) have the
    same shapes, each run one backend call (what an engine wants per layer)."""
    check_float(q, "q", 3)
    if not isinstance(kv, PagedKV):
        raise TypeError(f"kv must be a treeattn.PagedKV (PagedKV.wrap(kv_pages, kv_layout)), got {type(kv).__name__}")
    name = "kv_pages" if kv.layout == "TVM" else "k_pages"
    if kv.dtype != q.dtype:
        raise TypeError(f"{name} has dtype {kv.dtype}, expected {q.dtype} (the dtype of q)")
    if kv.device != q.device:
        raise ValueError(f"{name} is on {kv.device}, expected {q.device} (all inputs of one call on one device)")
    check_heads(q.shape[1], kv.num_kv_heads, q.shape[2], kv.head_dim, name)
    if plan is None:
        plan = TreeAttentionPlan.paged(q_indptr, page_indptr, page_indices, last_page_len, tree_indptr, tree_order,
                                       page_size=kv.page_size, num_pages=kv.num_pages, total_q=q.shape[0],
                                       device=q.device)
    else:
        _check_plan(plan, "paged")
        if plan.device != q.device or plan.total_q != q.shape[0] or plan.page_size != kv.page_size:
            raise ValueError("plan was built for a different batch: its lengths, page size or device do not match")
        if plan.page_id_bound > kv.num_pages:  # kernels would read past the end of the pages
            raise ValueError(f"plan uses page id {plan.page_id_bound - 1}, but {name} has only {kv.num_pages} pages")
        plan.check_inputs(q_indptr=q_indptr, page_indptr=page_indptr, page_indices=page_indices,
                          last_page_len=last_page_len, tree_indptr=tree_indptr, tree_order=tree_order)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[2])
    sinks = check_variants(sliding_window, logit_softcap, sinks, q.shape[1], q.device)
    spec = AttentionSpec(q.device, q.dtype, q.shape[1], kv.num_kv_heads, q.shape[2], kv.v_head_dim,
                         page_size=kv.page_size, **_variant_spec(sliding_window, logit_softcap, sinks))
    chosen = select(backend, spec)
    return PagedCall(chosen, plan.state(chosen, spec), plan, sm_scale, sinks, q, kv)


def merge_state(out_a, lse_a, out_b, lse_b, *, out=None, lse=None, backend=None):
    """Merge two partial attention results over disjoint key sets (base-2 LSEs). Returns ``(out, lse)``.

    ``out_*`` are ``[N, H, D]`` in one dtype, ``lse_*`` are float32 ``[N, H]``. A side with no keys
    (``lse`` equal to ``treeattn.lse.EMPTY_LSE`` or ``-inf``) gets zero weight whatever the other
    side's LSE; two empty sides give ``out = 0, lse = EMPTY_LSE``. ``out=out_a, lse=lse_a`` merges
    in place.
    """
    check_float(out_a, "out_a", 3)
    check_float(out_b, "out_b", 3, out_a.dtype, out_a.device)
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have the same shape, got {tuple(out_a.shape)} and {tuple(out_b.shape)}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.device != out_a.device:
            raise ValueError(f"{name} is on {x.device}, expected {out_a.device}")
        if tuple(x.shape) != tuple(out_a.shape[:2]):
            raise ValueError(f"{name} must have shape {tuple(out_a.shape[:2])}, got {tuple(x.shape)}")
    rows, heads, dim = out_a.shape
    spec = AttentionSpec(out_a.device, out_a.dtype, max(heads, 1), max(heads, 1), max(dim, 1), max(dim, 1))
    out, lse = _outputs(rows, heads, dim, out_a, out, lse)
    select(backend, spec).merge_state(out_a, lse_a, out_b, lse_b, out=out, lse=lse)
    return out, lse
