"""Triton kernels: tree attention over ragged or paged KV, split-KV merge, and merge_state.

One program of ``tree_attn_kernel`` owns one work item (request, block of query rows, KV column
range) for one KV head. Query rows are GQA-packed: flattened row ``r`` of a request is token
``r // group`` and query head ``kv_head * group + r % group``, so every KV tile is loaded once for
all the heads that read it. Columns before the tree (the prefix) need no mask, so full prefix tiles
take an unmasked path; only the remaining tiles (tree, ragged tail) load ``(enter, exit)`` per
column and run the ancestor interval test. Scores live in the log2 domain (``log2(e)`` folded into
``sm_scale``), so the softmax is ``exp2`` and the LSE comes out base 2, as TVM defines it.

A work item with ``split >= 0`` covers one chunk of a request's keys and writes a normalised
fp32 partial state to the workspace; ``merge_splits_kernel`` combines the chunks by LSE.
Work lists are padded for CUDA graphs: programs past ``counts[WORK_ITEMS]`` exit at once.

K and V are read in place through their own element strides ``(page, token, head)``: every
engine's page layout (TVM's combined pages, NHD, HND, views into a bigger buffer) and ragged
tensors (page stride unused) take the same code, with no copy. When K and V share their strides
(every layout but a V allocated unlike K), ``SAME_KV_STRIDES`` computes the addresses once for
both: a second address computation costs registers (spills on sm_90's 128-row tiles).

Attention variants are constexpr flags, so plain attention compiles to the same code as before:
``WINDOW`` (sliding window: each row's position and the tree keys' depths come from plan-time
tables; keys below every row's window in a block are never loaded, and the window's ragged edge
joins the masked loop), ``SOFTCAP`` (``c * tanh(s / c)`` through ``exp2``, then to log2 units),
``SINKS`` (the online softmax starts from the sink, a key of value 0; split chunks leave it to the
merge, so it counts once). V may have a head dim of its own (``V_HEAD_DIM``, ``BLOCK_DV``), and a
q/k head dim over 256 (MLA's 576) is a power-of-two block plus a tail block (``BLOCK_DT``): two
dots, rather than one padded to 1024.

Launched through ``launch.py`` (whose ``*_launch`` functions hold every kernel's argument list,
and which checks that triton was imported in the mode ``TRITON_INTERPRET`` asks for); ``aot.py``
compiles them for sm_80/sm_90 without a GPU.
"""

import triton
import triton.language as tl

from ...lse import EMPTY_LSE as _EMPTY_LSE
from ...lse import LOG2E as _LOG2E
from .tables import CountColumn, RequestColumn, WorkColumn

EMPTY_LSE = tl.constexpr(_EMPTY_LSE)
LOG2E = tl.constexpr(_LOG2E)
# Table columns (tables.py) as compile-time constants.
REQUEST_COLUMNS = tl.constexpr(len(RequestColumn))
R_Q_START = tl.constexpr(RequestColumn.Q_START.value)
R_QO_LEN = tl.constexpr(RequestColumn.QO_LEN.value)
R_KV_START = tl.constexpr(RequestColumn.KV_START.value)
R_KV_LEN = tl.constexpr(RequestColumn.KV_LEN.value)
R_TREE_START = tl.constexpr(RequestColumn.TREE_START.value)
R_TREE_SIZE = tl.constexpr(RequestColumn.TREE_SIZE.value)
R_SPLITS = tl.constexpr(RequestColumn.SPLITS.value)
R_PART_START = tl.constexpr(RequestColumn.PART_START.value)
WORK_COLUMNS = tl.constexpr(len(WorkColumn))
W_REQUEST = tl.constexpr(WorkColumn.REQUEST.value)
W_FIRST_ROW = tl.constexpr(WorkColumn.FIRST_ROW.value)
W_KV_LO = tl.constexpr(WorkColumn.KV_LO.value)
W_KV_HI = tl.constexpr(WorkColumn.KV_HI.value)
W_SPLIT = tl.constexpr(WorkColumn.SPLIT.value)
C_WORK_ITEMS = tl.constexpr(CountColumn.WORK_ITEMS.value)
C_TOKENS = tl.constexpr(CountColumn.TOKENS.value)


@triton.jit
def rope_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, num_rows, num_heads, stride_xt, stride_xh, rope_scale, rope_mult,
                HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROPE_DIVIDE: tl.constexpr):
    """Rotate-half RoPE of ``x [L, H, d]`` at integer positions ``[L]`` into contiguous ``out``, TVM's
    formula: ``angle = s / g`` (or ``s * g``), ``s = float32(pos) * scale``, cos/sin times the
    multiplier, all fp32, rounded to the storage dtype (TVM rounds before its dot products).

    A pass of its own, before attention, rather than fused into the tiles: precise fp32 sin/cos
    (needed for angles up to ~1e5 rad) is long libdevice code, which per KV tile would be
    recomputed by every program that reads the tile and would bloat the attention kernel."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < num_rows
    tok = (rows // num_heads).to(tl.int64)
    head = rows % num_heads
    d_ok = offs_d < HEAD_DIM
    mask = r_ok[:, None] & d_ok[None, :]
    base = tok * stride_xt + head * stride_xh
    x = tl.load(x_ptr + base[:, None] + offs_d[None, :], mask=mask, other=0.0)
    partner_d = tl.where(offs_d < HEAD_DIM // 2, offs_d + HEAD_DIM // 2, offs_d - HEAD_DIM // 2)
    partner = tl.load(x_ptr + base[:, None] + partner_d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.where((offs_d < HEAD_DIM // 2)[None, :], -partner, partner)
    g = tl.load(freq_ptr + offs_d, mask=d_ok, other=1.0)
    s = tl.load(pos_ptr + tok, mask=r_ok, other=0).to(tl.float32) * rope_scale
    if ROPE_DIVIDE:
        angle = tl.math.div_rn(s[:, None], g[None, :])
    else:
        angle = s[:, None] * g[None, :]
    cos = tl.cos(angle) * rope_mult
    sin = tl.sin(angle) * rope_mult
    roped = cos * x.to(tl.float32) + sin * partner
    flat = rows.to(tl.int64)
    tl.store(out_ptr + flat[:, None] * HEAD_DIM + offs_d[None, :], roped.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """``a @ b`` with fp32 accumulation: exact fp32 FMA ("ieee") on fp32 inputs, else tensor cores in b's dtype."""
    if FP32_DOT:
        out = tl.dot(a, b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(b.dtype), b)
    return out


@triton.jit
def _tanh(x):
    """tanh as ``1 - 2 / (e^(2x) + 1)`` through exp2 (no libdevice call; the interpreter runs it too). It
    saturates cleanly: ``e^(2x) = inf`` gives 1, ``0`` gives -1."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_tail, start, kv_hi, kv_start, offs_d, offs_dt, offs_dv, enter_row, row_lo,
                 tree_kv_start, tree_start, k_head_ptr, v_head_ptr, stride_kp, stride_kt, stride_vp, stride_vt,
                 page_indices_ptr, page_log2, tree_order_ptr, depth_ptr, qk_scale, cap_scale,
                 MASKED: tl.constexpr, PAGED: tl.constexpr, SAME_KV_STRIDES: tl.constexpr, HEAD_DIM: tl.constexpr,
                 V_HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
                 BLOCK_DV: tl.constexpr, FP32_DOT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """One KV tile of the online softmax. ``MASKED=False`` is the fast path for tiles every row sees
    whole: no column bound, no tree or window test. ``k_head_ptr``/``v_head_ptr`` point at the program's
    KV head (of token 0 of page 0). ``row_lo`` is each row's first visible position (``WINDOW``)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    col_ok = offs_n < kv_hi
    # Broadcast over columns (all true unless a head dim is padded); masked tiles also bound the columns.
    k_mask = (offs_d < HEAD_DIM)[None, :]
    t_mask = (offs_dt < HEAD_DIM)[None, :]
    v_mask = (offs_dv < V_HEAD_DIM)[None, :]
    if MASKED:
        k_mask = col_ok[:, None] & k_mask
        t_mask = col_ok[:, None] & t_mask
        v_mask = col_ok[:, None] & v_mask
    if PAGED:
        if MASKED:
            page = tl.load(page_indices_ptr + kv_start + (offs_n >> page_log2), mask=col_ok, other=0)
        else:
            page = tl.load(page_indices_ptr + kv_start + (offs_n >> page_log2))
        page = page.to(tl.int64)
        token = (offs_n & ((1 << page_log2) - 1)).to(tl.int64)  # offset in its page
        k_row = page * stride_kp + token * stride_kt
        v_row = page * stride_vp + token * stride_vt
    else:
        token = (kv_start + offs_n).to(tl.int64)
        k_row = token * stride_kt
        v_row = token * stride_vt
    k_off = k_row[:, None] + offs_d[None, :]
    if SAME_KV_STRIDES:
        if BLOCK_DV == BLOCK_D:
            v_off = k_off  # one address computation for both (a second one costs registers: spills on sm_90)
        else:
            v_off = k_row[:, None] + offs_dv[None, :]  # MLA: V is a view of K's first dims
    else:
        v_off = v_row[:, None] + offs_dv[None, :]
    k = tl.load(k_head_ptr + k_off, mask=k_mask, other=0.0)
    v = tl.load(v_head_ptr + v_off, mask=v_mask, other=0.0)
    qk = _dot(q, tl.trans(k), FP32_DOT)
    if BLOCK_DT > 0:  # the q/k dims past BLOCK_D (MLA's RoPE dims): a second dot, not a padded first one
        k_tail = tl.load(k_head_ptr + k_row[:, None] + offs_dt[None, :], mask=t_mask, other=0.0)
        qk += _dot(q_tail, tl.trans(k_tail), FP32_DOT)
    if SOFTCAP:  # c * tanh(s / c) of the scaled score s, then to log2 units (qk_scale = c * log2 e)
        qk = _tanh(qk * cap_scale) * qk_scale
    else:
        qk = qk * qk_scale
    if MASKED:
        anc = offs_n - tree_kv_start
        in_tree = (anc >= 0) & col_ok
        e_col = tl.load(tree_order_ptr + (tree_start + anc) * 2, mask=in_tree, other=0)
        x_col = tl.load(tree_order_ptr + (tree_start + anc) * 2 + 1, mask=in_tree, other=0)
        is_anc = (e_col[None, :] <= enter_row[:, None]) & (enter_row[:, None] < x_col[None, :])
        allowed = col_ok[None, :] & ((anc < 0)[None, :] | is_anc)
        if WINDOW:  # prefix key j is at position j, tree node i at prefix + depth(i)
            depth = tl.load(depth_ptr + tree_start + anc, mask=in_tree, other=0)
            key_pos = tl.where(in_tree, tree_kv_start + depth, offs_n)
            allowed = allowed & (key_pos[None, :] >= row_lo[:, None])
        qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p, v, FP32_DOT)
    return acc, m_new, l_i


@triton.jit
def tree_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, o_part_ptr, lse_part_ptr,
    requests_ptr, work_ptr, counts_ptr, tree_order_ptr, page_indices_ptr, row_pos_ptr, depth_ptr, sinks_ptr,
    qk_scale, cap_scale, window,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, page_log2, num_q_heads,
    group,
    HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, SAME_KV_STRIDES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_DV: tl.constexpr, FP32_DOT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    if pid >= tl.load(counts_ptr + C_WORK_ITEMS):
        return
    w = work_ptr + pid * WORK_COLUMNS
    b = tl.load(w + W_REQUEST)
    row0 = tl.load(w + W_FIRST_ROW)
    kv_lo = tl.load(w + W_KV_LO)
    kv_hi = tl.load(w + W_KV_HI)
    split = tl.load(w + W_SPLIT)
    r = requests_ptr + b * REQUEST_COLUMNS
    q_start = tl.load(r + R_Q_START)
    qo_len = tl.load(r + R_QO_LEN)
    kv_start = tl.load(r + R_KV_START)
    kv_len = tl.load(r + R_KV_LEN)
    tree_start = tl.load(r + R_TREE_START)
    tree_size = tl.load(r + R_TREE_SIZE)
    part_start = tl.load(r + R_PART_START)

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < qo_len * group
    tok = offs_m // group
    head = kv_head * group + offs_m % group
    q_row = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_row[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
                other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    offs_dt = offs_d  # no tail: never read
    q_tail = q
    if BLOCK_DT > 0:
        offs_dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        q_tail = tl.load(q_ptr + q_row[:, None] + offs_dt[None, :],
                         mask=row_ok[:, None] & (offs_dt < HEAD_DIM)[None, :], other=0.0)
        if FP32_DOT:
            q_tail = q_tail.to(tl.float32)

    # The tree is the last tree_size keys; query row r is node r + tree_size - qo_len.
    tree_kv_start = kv_len - tree_size
    has_tree = row_ok & (tree_size > 0)
    enter_row = tl.load(tree_order_ptr + (tree_start + tok + tree_size - qo_len) * 2, mask=has_tree, other=0)

    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile then adds exactly 0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        # A sink is a key of value 0 and score sinks[h]: the online softmax starts from it, so it joins the
        # denominator and the LSE once (a row without keys: out 0, lse the sink's). A split request's
        # chunks start empty and merge_splits_kernel adds the sink instead.
        whole = split < 0
        sink = tl.load(sinks_ptr + head, mask=row_ok & whole, other=0.0) * LOG2E
        m_i = tl.where(whole, sink, m_i)
        l_i = tl.where(whole, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    row_lo = tok  # each row's first visible position; only read with a window
    full_lo = kv_lo  # keys from here to the tree are seen by every row: no mask
    if WINDOW:
        # Keys below every row's window are not read at all: the work item starts at its row block's
        # window floor (partition.window_floors). Keys up to the highest row's window start are the
        # window's ragged edge and need the mask; past it, the prefix is whole again.
        row_lo = tl.load(row_pos_ptr + q_start + tok, mask=row_ok, other=0) - window + 1
        first = kv_lo
        full_lo = tl.maximum(first, tl.minimum(tl.max(tl.where(row_ok, row_lo, 0), 0),
                                               tl.minimum(tree_kv_start, kv_hi)))
    unmasked_end = full_lo + tl.maximum(tl.minimum(kv_hi, tree_kv_start) - full_lo, 0) // BLOCK_N * BLOCK_N
    for start in range(full_lo, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_tail, start, kv_hi, kv_start, offs_d, offs_dt, offs_dv, enter_row, row_lo,
            tree_kv_start, tree_start, k_head_ptr, v_head_ptr, stride_kp, stride_kt, stride_vp, stride_vt,
            page_indices_ptr, page_log2, tree_order_ptr, depth_ptr, qk_scale, cap_scale, False, PAGED,
            SAME_KV_STRIDES, HEAD_DIM, V_HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_DT, BLOCK_DV, FP32_DOT, WINDOW, SOFTCAP)
    if WINDOW:
        # The edge [first, full_lo) and the rest [unmasked_end, kv_hi) in one masked loop: a second loop
        # body would hold its own registers (measured: register spills at the largest tiles).
        edge_tiles = tl.cdiv(full_lo - first, BLOCK_N)
        for i in range(0, edge_tiles + tl.cdiv(tl.maximum(kv_hi - unmasked_end, 0), BLOCK_N)):
            in_edge = i < edge_tiles
            start = tl.where(in_edge, first + i * BLOCK_N, unmasked_end + (i - edge_tiles) * BLOCK_N)
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_tail, start, tl.where(in_edge, full_lo, kv_hi), kv_start, offs_d, offs_dt,
                offs_dv, enter_row, row_lo, tree_kv_start, tree_start, k_head_ptr, v_head_ptr, stride_kp, stride_kt,
                stride_vp, stride_vt, page_indices_ptr, page_log2, tree_order_ptr, depth_ptr, qk_scale, cap_scale,
                True, PAGED, SAME_KV_STRIDES, HEAD_DIM, V_HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_DT, BLOCK_DV, FP32_DOT,
                WINDOW, SOFTCAP)
    else:
        for start in range(unmasked_end, kv_hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_tail, start, kv_hi, kv_start, offs_d, offs_dt, offs_dv, enter_row, row_lo,
                tree_kv_start, tree_start, k_head_ptr, v_head_ptr, stride_kp, stride_kt, stride_vp, stride_vt,
                page_indices_ptr, page_log2, tree_order_ptr, depth_ptr, qk_scale, cap_scale, True, PAGED,
                SAME_KV_STRIDES, HEAD_DIM, V_HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_DT, BLOCK_DV, FP32_DOT, WINDOW,
                SOFTCAP)

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if split < 0:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), EMPTY_LSE)
        out_row = (q_start + tok).to(tl.int64) * num_q_heads + head
        tl.store(out_ptr + out_row[:, None] * V_HEAD_DIM + offs_dv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dv < V_HEAD_DIM)[None, :])
        tl.store(lse_ptr + out_row, lse, mask=row_ok)
    else:  # a chunk's state, without the sinks: merge_splits_kernel adds them once
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        part_row = (part_start + split * qo_len + tok).to(tl.int64) * num_q_heads + head
        tl.store(o_part_ptr + part_row[:, None] * BLOCK_DV + offs_dv[None, :], o, mask=row_ok[:, None])
        tl.store(lse_part_ptr + part_row, lse, mask=row_ok)


@triton.jit
def merge_splits_kernel(out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, requests_ptr, token_request_ptr, counts_ptr,
                        sinks_ptr, num_q_heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    """Combine a split request's per-chunk states for one token and a block of heads by their LSEs, and
    the sinks (``SINKS``), which no chunk counted, as one more term of value 0."""
    t = tl.program_id(0)
    if t >= tl.load(counts_ptr + C_TOKENS):
        return
    b = tl.load(token_request_ptr + t)
    r = requests_ptr + b * REQUEST_COLUMNS
    num_splits = tl.load(r + R_SPLITS)
    if num_splits <= 1:
        return
    q_start = tl.load(r + R_Q_START)
    qo_len = tl.load(r + R_QO_LEN)
    part_start = tl.load(r + R_PART_START)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_q_heads
    first = (part_start + t - q_start).to(tl.int64)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(lse_part_ptr + (first + s * qo_len) * num_q_heads + offs_h, mask=h_ok,
                                  other=float("-inf")))
    den = tl.zeros([BLOCK_H], tl.float32)
    if SINKS:
        sink = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0) * LOG2E
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row no chunk saw: keeps the weights finite (all 0)
    if SINKS:
        den += tl.exp2(sink - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(num_splits):
        row = (first + s * qo_len) * num_q_heads + offs_h
        wgt = tl.exp2(tl.load(lse_part_ptr + row, mask=h_ok, other=float("-inf")) - m)
        o = tl.load(o_part_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=h_ok[:, None], other=0.0)
        den += wgt
        acc += wgt[:, None] * o
    seen = den > 0.0
    o = acc / tl.where(seen, den, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log2(tl.where(seen, den, 1.0)), EMPTY_LSE)
    out_row = t.to(tl.int64) * num_q_heads + offs_h
    tl.store(out_ptr + out_row[:, None] * HEAD_DIM + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(lse_ptr + out_row, lse, mask=h_ok)


@triton.jit
def merge_state_kernel(out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr, num_rows, num_heads,
                       stride_an, stride_ah, stride_bn, stride_bh, stride_lan, stride_lah, stride_lbn, stride_lbh,
                       HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``merge_state`` over flattened (row, head) pairs, fp32 math, as ``treeattn.lse.merge`` defines it:
    weights ``exp2(lse - max)`` over the sides that have keys; a side with no keys (``EMPTY_LSE`` or
    ``-inf``) weighs 0 whatever the other's LSE and its output is never read into the sum; two empty
    sides give ``out = 0``, ``lse = EMPTY_LSE``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < num_rows * num_heads
    n = (rows // num_heads).to(tl.int64)
    h = rows % num_heads
    la = tl.load(lse_a_ptr + n * stride_lan + h * stride_lah, mask=r_ok, other=float("-inf"))
    lb = tl.load(lse_b_ptr + n * stride_lbn + h * stride_lbh, mask=r_ok, other=float("-inf"))
    empty_a = (la == EMPTY_LSE) | (la == float("-inf"))
    empty_b = (lb == EMPTY_LSE) | (lb == float("-inf"))
    m = tl.maximum(tl.where(empty_a, float("-inf"), la), tl.where(empty_b, float("-inf"), lb))
    m = tl.where(empty_a & empty_b, 0.0, m)
    wa = tl.where(empty_a, 0.0, tl.exp2(la - m))
    wb = tl.where(empty_b, 0.0, tl.exp2(lb - m))
    total = wa + wb
    none = total == 0.0
    wa = wa / tl.where(none, 1.0, total)
    wb = wb / tl.where(none, 1.0, total)
    d_ok = (offs_d < HEAD_DIM)[None, :]
    oa = tl.load(out_a_ptr + (n * stride_an + h * stride_ah)[:, None] + offs_d[None, :],
                 mask=(r_ok & (wa > 0.0))[:, None] & d_ok, other=0.0)
    ob = tl.load(out_b_ptr + (n * stride_bn + h * stride_bh)[:, None] + offs_d[None, :],
                 mask=(r_ok & (wb > 0.0))[:, None] & d_ok, other=0.0)
    merged = oa.to(tl.float32) * wa[:, None] + ob.to(tl.float32) * wb[:, None]
    flat = rows.to(tl.int64)
    tl.store(out_ptr + flat[:, None] * HEAD_DIM + offs_d[None, :], merged.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & d_ok)
    tl.store(lse_ptr + flat, tl.where(none, EMPTY_LSE, tl.log2(tl.where(none, 1.0, total)) + m), mask=r_ok)
