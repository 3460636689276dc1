"""Native CPU backend: a C++ tree-attention kernel for the whole batch in one call.

The kernel (``csrc/``) vectorises over query rows: the ``T x group`` rows that read one KV head are
packed transposed, so each key and value row is read once, in place, for all of them (any ragged or
paged layout, through element strides), with fp32 accumulation and an online base-2 softmax. The
ancestor test runs only on tiles that hold tree keys, and drops invisible keys with a bit mask.
Long prefixes are split across threads when there are too few (request, head) items, and merged by
LSE inside the same call.

Kernel paths (``isas()``: the ones this CPU has), picked per dtype at run time:
- ``brgemm-avx512`` / ``brgemm-avx2``: each tile's two GEMMs (S = Q K^T for all rows of a KV head, O += P V)
  on oneDNN's brgemm micro-kernels as PyTorch exports them (AMX, AVX512-BF16, AVX512-FP16, AVX-512 or
  AVX2, JIT-compiled for the running CPU), P rounded to the dtype, the online softmax and masks on AVX-512
  or AVX2 vectors (``csrc/kernel_brgemm.hpp``). PyTorch's brgemm has 16-bit kernels only on some CPUs
  (bf16 from AVX-512, natively with AVX512-BF16 or AMX; fp16 from AVX512-FP16, which reads B plain where
  the others read VNNI pairs: probed once per process, ``brgemm_b_pairs``), so a 16-bit dtype tries them
  only there (``brgemm_dtypes``), and each (path, dtype) checks itself once per process on first use
  against the FMA kernel on a small problem, and is switched off, with one warning saying why, when it
  throws or disagrees;
- ``avx512`` / ``avx2`` / ``generic``: the FMA kernel (``csrc/kernel.hpp``) on 16 or 8 fp32 lanes, or
  portable C++; every dtype is widened to fp32.
The default takes, per dtype, the first of ``_ORDER``'s paths this CPU has, a brgemm path only where it
passes its check and pays (it runs a probe of serving steps, tree verifications and a prefill, at least
1.05x as fast as the FMA kernel here).
``TREEATTN_NATIVE_ISA`` or ``NativeBackend(isa=...)`` forces one path for every dtype.

Every attention variant runs in the kernel: a sliding window bounds each work item's keys (keys below
every row's window are never read; only the window's ragged edge, as wide as the tree is deep, is
masked); soft-capping applies a vectorised rational tanh to the scores; sinks start each row's online
softmax (a split prefix's chunks leave them out, and the merge adds them once); V may have a head dim
of its own, and MLA's absorbed form (V a view of K's first dims) reads V from the packed K tile.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import NamedTuple

import numpy as np
import torch

from ..base import AttentionSpec, Backend
from .build import EXTENSION, Extension

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_GROUP = 256  # ROW_BLOCK in csrc/problem.h: a work item holds whole query tokens
_NONE = torch.zeros(0)  # an absent optional tensor (sinks, positions)
_MAX_WINDOW = 1 << 62  # larger windows (past any context) are passed as this, within int64


# Path preference, every dtype (names that this CPU lacks are skipped). A brgemm path is taken for a dtype
# only where it is correct here (its self-check) and pays: on a probe of serving steps (`speed`,
# once per process and dtype, on the process's threads) it runs at least _MIN_GAIN times as fast as the
# best FMA path. The kernels are timed, not the chips' peaks: the brgemm kernel spends its FLOPs in
# oneDNN's GEMMs at ~90% of their peak, the FMA kernel at ~45% of its own, so peaks mislead. Measured on
# a Sapphire Rapids (2 threads, brgemm-avx512 against avx512, h 32/8 or 9/3): bf16 (AMX) 2.5-5x; fp32
# 0.97-1.25x (1.12-1.21x on batches of 16-node trees, though its GEMM peak is 0.8x the FMA peak); fp16 0.7-0.85x
# (AVX512-FP16 without AMX-FP16: oneDNN widens to fp32). _MIN_GAIN keeps the FMA kernel where the two tie
# within the probe's noise. A forced path (TREEATTN_NATIVE_ISA, isa=...) runs whether or not it pays.
_ORDER = ("brgemm-avx512", "brgemm-avx2", "avx512", "avx2", "generic")
# Forces the brgemm path's loop on bf16 pairs for bf16 items of few rows on or off (csrc/kernel_rows_bf16.hpp);
# unset, `pairs` times the loop against the path's GEMMs on this CPU (AVX512-BF16, or AMX's tiles).
PAIRS_ENV_VAR = "TREEATTN_NATIVE_BF16_PAIRS"
_MIN_GAIN = 1.05
# A brgemm path's self-check tolerance against the FMA kernel (both accumulate in fp32), absolute and
# relative: both round the output to the dtype (an ulp each: 2^-8 bf16, 2^-11 fp16), and the brgemm path
# also rounds P (its products add up to at most another ulp); fp32 differs in summation order only.
_CHECK_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _brgemm(isa: str) -> bool:
    return isa.startswith("brgemm-")


def _forced_pairs() -> str:
    """TREEATTN_NATIVE_BF16_PAIRS: "on", "off", or "" (unset: measured, NativeBackend.pairs)."""
    forced = os.environ.get(PAIRS_ENV_VAR, "")
    if forced not in ("", "on", "off"):
        raise ValueError(f"{PAIRS_ENV_VAR} must be 'on' or 'off' (unset: measured on this CPU), got {forced!r}")
    return forced


def _dims_major_paged(batch, page_size: int):
    """(plan, PagedKV) of a test batch's pages with K stored dims-major within each page, as vLLM's CPU
    cache keeps it (the native kernel's own packing)."""
    from ...layout import PagedKV
    from ...plan import TreeAttentionPlan

    e = batch.extra
    pages = e["kv_pages"]  # [pages, 2, h_kv, page_size, d]
    kv = PagedKV.wrap((pages[:, 0].transpose(2, 3).contiguous().transpose(2, 3), pages[:, 1]), "HND")
    plan = TreeAttentionPlan.paged(batch.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"],
                                   batch.tree_indptr, batch.tree_order, page_size=page_size,
                                   num_pages=pages.shape[0])
    return plan, kv


class _State(NamedTuple):
    """Per-plan host tables, read-only once built (safe to share between threads)."""

    meta: torch.Tensor  # int64 [7, batch]: q_starts, qo_lens, kv_starts, kv_lens, tree_starts, tree_sizes, page_starts
    order: torch.Tensor  # int32 [nodes, 2]
    pages: torch.Tensor  # int32 page ids (empty when ragged)
    window: int  # sliding window (0: none)
    softcap: float  # logit soft-cap (0: none)
    row_pos: torch.Tensor  # int64 [total_q] query rows' positions (window only; else empty)
    depths: torch.Tensor  # int64 [nodes] tree nodes' depths (window only; else empty)
    isa: str  # the kernel path that runs it
    pairs: bool  # bf16 items of few rows on AVX512-BF16's pairs (NativeBackend.pairs)


class NativeBackend(Backend):
    name = "native"
    # (extension, path, dtype) -> why the brgemm path failed its self-check, or None: once per process.
    _checks: dict[tuple[Extension, str, torch.dtype], str | None] = {}
    # (extension, brgemm path, dtype) -> (its, the FMA kernel's) GFLOP/s on a probe (see speed): once per process.
    _speeds: dict[tuple[Extension, str, torch.dtype], tuple[float, float]] = {}
    # (extension, brgemm path) -> (its bf16 pairs', its GEMMs') GFLOP/s on a probe of decodes (see pair_speed).
    _pair_speeds: dict[tuple[Extension, str], tuple[float, float]] = {}
    _check_lock = threading.RLock()  # reentrant: a self-check's plan asks for pair_speed

    def __init__(self, isa: str | None = None, extension: Extension = EXTENSION):
        self.isa = isa if isa is not None else os.environ.get("TREEATTN_NATIVE_ISA", "")
        _forced_pairs()
        self.extension = extension

    def unavailable(self) -> str | None:
        return self.extension.failure()

    def isas(self) -> list[str]:
        """The kernel paths this CPU can run (brgemm ones whether or not oneDNN has a dtype's kernels)."""
        return list(self.extension.module().isas())

    def brgemm_dtypes(self) -> list[torch.dtype]:
        """The dtypes PyTorch's brgemm accepts on this CPU: float32 (from AVX2), bfloat16 from AVX-512
        (natively with AVX512-BF16 or AMX, emulated below) and float16 from AVX512-FP16."""
        return [torch.float32] + [getattr(torch, name) for name in self.extension.module().brgemm_16bit()]

    def path(self, dtype: torch.dtype) -> str:
        """The kernel path that runs ``dtype``: the forced one; else the first brgemm path of ``_ORDER``
        this CPU has that passes its self-check, if it pays (``speed``); else the first FMA path. A dtype
        PyTorch's brgemm does not take here (``brgemm_dtypes``) tries no brgemm path, and warns of nothing."""
        if self.isa:
            return self.isa
        have = self.isas()
        brgemm = next((isa for isa in _ORDER if isa in have and _brgemm(isa) and not self.off(isa, dtype)), None)
        return brgemm if brgemm and self.pays(brgemm, dtype) else self.fma_path()

    def off(self, isa: str, dtype: torch.dtype) -> str | None:
        """Why kernel path ``isa`` (one of ``isas``) cannot be trusted with ``dtype`` on this CPU (None: it
        can): a brgemm path where PyTorch's brgemm has no kernels for the dtype (no warning), or one that
        failed its self-check. The FMA paths run every dtype."""
        if not _brgemm(isa):
            return None
        if dtype not in self.brgemm_dtypes():
            return f"oneDNN has no {str(dtype).removeprefix('torch.')} brgemm kernels on this CPU"
        return self.check(isa, dtype)

    def fma_path(self) -> str:
        """The best FMA-kernel path this CPU has: what brgemm paths are checked and timed against."""
        have = self.isas()
        return next(isa for isa in _ORDER if isa in have and not _brgemm(isa))

    def pays(self, isa: str, dtype: torch.dtype) -> bool:
        """Whether brgemm path ``isa`` runs ``dtype`` at least ``_MIN_GAIN`` times as fast as the FMA kernel."""
        brgemm, fma = self.speed(isa, dtype)
        return brgemm >= _MIN_GAIN * fma

    def speed(self, isa: str, dtype: torch.dtype) -> tuple[float, float]:
        """(brgemm path ``isa``'s, the best FMA path's) GFLOP/s on ``dtype`` serving steps: a probe of 4
        requests of 16-node trees after 1000-token prefixes and a 256-token prefill (h 16/4, d 128, 0.8
        GFLOP), on this process's threads, the best of 3 interleaved calls each; measured once per process;
        0.0 for a path that raises. The prefill is there since the tree steps alone tie in fp32 on a Zen 5
        (brgemm 0.99-1.16x the FMA kernel over nine processes, each taking either path) while prefills run
        1.07-1.19x faster on brgemm there."""
        key = (self.extension, isa, dtype)
        with self._check_lock:
            if key not in self._speeds:
                self._speeds[key] = self._probe(isa, dtype)
            return self._speeds[key]

    def _probe(self, isa: str, dtype: torch.dtype) -> tuple[float, float]:
        from ...plan import TreeAttentionPlan
        from ...testing import Request, chain, make_batch, random_tree
        from ...tree import tree_depths

        rng = np.random.default_rng(0)
        requests = [Request(random_tree(rng, 16), prefix=1000) for _ in range(4)] + [Request(chain(256))]
        batch = make_batch(requests, h_q=16, h_kv=4, d=128, dtype=dtype, seed=7)
        visible = sum(r.n * r.prefix + int((tree_depths(r.parents) + 1).sum()) for r in requests)
        flops = 4.0 * 16 * 128 * visible
        plan = TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
        spec = AttentionSpec(torch.device("cpu"), dtype, 16, 4, 128, 128)
        states = [self._state(plan, spec, name, pairs=False) for name in (isa, self.fma_path())]  # no few-row items
        return self._race(batch.q, batch.k, batch.v, 0, states, flops)

    def pairs(self, isa: str) -> bool:
        """Whether kernel path ``isa`` runs bf16 items of few query rows (decodes, small trees: at most 24 rows
        with K dims-major as vLLM stores it, 4 with K as rows) on AVX512-BF16's bf16 pairs
        (``csrc/kernel_rows_bf16.hpp``) rather than through its GEMMs: only brgemm-avx512 on a CPU with the
        pairs, and there as ``TREEATTN_NATIVE_BF16_PAIRS`` forces, else where they run a probe of decodes at
        least as fast (``pair_speed``). On a Zen 5 (AVX512-BF16, no AMX) they ran such items 1.2-1.8x as fast
        (``csrc/kernel_brgemm.hpp``); against AMX's tiles, the probe decides on each machine."""
        forced = _forced_pairs()  # checked on every plan: it may be set after the backend was made
        if isa != "brgemm-avx512" or not self.extension.module().bf16_pairs():
            return False
        if forced:
            return forced == "on"
        pairs, gemms = self.pair_speed(isa)
        return pairs > 0 and pairs >= gemms  # (both raising: 0 and 0, and the self-check says why)

    def pair_speed(self, isa: str) -> tuple[float, float]:
        """(the bf16 pairs', brgemm path ``isa``'s own) GFLOP/s on bf16 decodes: 16 requests of one token
        after 500-token prefixes (h 16/4: 4 rows per item, d 128), K dims-major in 16-token pages; on this
        process's threads, the best of 3 interleaved calls each; measured once per process."""
        key = (self.extension, isa)
        with self._check_lock:
            if key not in self._pair_speeds:
                self._pair_speeds[key] = self._probe_pairs(isa)
            return self._pair_speeds[key]

    def _probe_pairs(self, isa: str) -> tuple[float, float]:
        from ...testing import Request, make_batch

        batch = make_batch([Request((), prefix=500, qo=1)] * 16, h_q=16, h_kv=4, d=128, dtype=torch.bfloat16,
                           seed=7, page_size=16)
        plan, kv = _dims_major_paged(batch, 16)
        spec = AttentionSpec(torch.device("cpu"), torch.bfloat16, 16, 4, 128, 128)
        states = [self._state(plan, spec, isa, pairs=on) for on in (True, False)]
        return self._race(batch.q, kv.k, kv.v, 16, states, 4.0 * 16 * 128 * 16 * 501)

    def _race(self, q, k, v, page_size: int, states: list[_State], flops: float) -> tuple[float, ...]:
        """Each state's GFLOP/s on one call, the best of 3 rounds after a warm-up round (which also builds
        oneDNN's kernels), the states taking turns; 0.0 for one that raises (no kernel for the dtype here:
        the self-check says why)."""
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2])
        times: list[list[float] | None] = [[] for _ in states]
        for round_ in range(4):
            for i, state in enumerate(states):
                if times[i] is None:
                    continue
                start = time.perf_counter()
                try:
                    self._run(q, k, v, state, page_size, 0.125, out, lse, None)
                except Exception:
                    times[i] = None
                    continue
                if round_:
                    times[i].append(time.perf_counter() - start)
        return tuple(flops / min(t) / 1e9 if t else 0.0 for t in times)

    def check(self, isa: str, dtype: torch.dtype) -> str | None:
        """Why brgemm path ``isa`` cannot be trusted with ``dtype`` here (None: it can). Checked once per
        process: one small call against the FMA kernel; a failure warns once."""
        key = (self.extension, isa, dtype)
        with self._check_lock:
            if key not in self._checks:
                self._checks[key] = reason = self._self_check(isa, dtype)
                if reason:
                    warnings.warn(f"treeattn: native kernel path {isa!r} is off for {dtype}: {reason}",
                                  RuntimeWarning, stacklevel=3)
            return self._checks[key]

    def _self_check(self, isa: str, dtype: torch.dtype) -> str | None:
        from ...plan import TreeAttentionPlan
        from ...testing import Request, binary, make_batch

        # Two tiles and a short one, a tree with queries, requests without a tree (12 and 4 rows: items of
        # few rows), a GQA group of 4; the keys ragged, and in pages with K stored dims-major (vLLM's CPU
        # cache: its own packing) of 16 tokens (tiles copied a page at a time) and of 64 (whole tiles in place).
        requests = [Request(binary(13), prefix=150), Request((), prefix=70, qo=3), Request((), prefix=40, qo=1)]
        cases = []
        for page_size in (16, 64):
            batch = make_batch(requests, h_q=8, h_kv=2, d=64, dtype=dtype, seed=1234, page_size=page_size)
            if not cases:
                cases.append((batch, TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr,
                                                              batch.tree_order), batch.k, batch.v, 0))
            plan, kv = _dims_major_paged(batch, page_size)
            cases.append((batch, plan, kv.k, kv.v, page_size))
        spec = AttentionSpec(torch.device("cpu"), dtype, 8, 2, 64, 64)
        baseline = self.fma_path()
        for batch, plan, k, v, page_size in cases:
            results = []
            for name in (isa, baseline):
                out = torch.full_like(batch.q, float("nan"))
                lse = torch.full(batch.q.shape[:2], float("nan"))
                state = self._state(plan, spec, name)
                try:
                    self._run(batch.q, k, v, state, page_size, 0.125, out, lse, None)
                except Exception as exc:  # oneDNN has no kernel for this dtype here, or the path is broken
                    message = str(exc).strip()
                    return f"it raised {type(exc).__name__}: {message.splitlines()[0] if message else ''}"
                results.append((out.float(), lse))
            (out, lse), (want, want_lse) = results
            tol = _CHECK_TOL[dtype]
            error = ((out - want).abs() - tol * want.abs()).max().item()
            lse_error = ((lse - want_lse).abs() - 1e-4 * want_lse.abs()).max().item()
            if not error <= tol or not lse_error <= 1e-4:  # NaN fails too
                layout = f"{page_size}-token pages, K dims-major" if page_size else "ragged"
                return (f"its output ({layout}) differs from the {baseline!r} path's by {error + tol:.3g} beyond "
                        f"{tol:g} (LSE: {lse_error + 1e-4:.3g})")
        return None

    def unsupported(self, spec: AttentionSpec) -> str | None:
        if spec.device.type != "cpu":
            return f"runs on the CPU only, got {spec.device}"
        if spec.dtype not in _DTYPES:
            return f"needs float32, float16 or bfloat16, got {spec.dtype}"
        if spec.group > _MAX_GROUP:
            return f"at most {_MAX_GROUP} query heads per KV head, got {spec.group}"
        if self.isa and self.isa not in self.isas():
            return f"kernel path {self.isa!r} is not available on this CPU ({', '.join(self.isas())})"
        if self.isa and _brgemm(self.isa):
            reason = self.check(self.isa, spec.dtype)
            if reason:
                return f"kernel path {self.isa!r} failed its self-check for {spec.dtype}: {reason}"
        return None

    def plan(self, plan, spec: AttentionSpec) -> _State:
        return self._state(plan, spec, self.path(spec.dtype))

    def _state(self, plan, spec: AttentionSpec, isa: str, pairs: bool | None = None) -> _State:
        batch = plan.batch_size
        zeros = np.zeros(batch, dtype=np.int64)
        meta = np.stack([plan.q_starts, plan.qo_lens, zeros if plan.kv_starts is None else plan.kv_starts,
                         plan.kv_lens, plan.tree_starts, plan.tree_sizes,
                         zeros if plan.page_starts is None else plan.page_starts]).astype(np.int64)
        pages = plan.page_indices if plan.page_indices is not None else torch.zeros(0, dtype=torch.int32)
        window = spec.sliding_window
        row_pos = depths = _NONE
        if window is not None:
            row_pos = torch.from_numpy(np.ascontiguousarray(plan.row_positions, dtype=np.int64))
            depths = torch.from_numpy(np.ascontiguousarray(plan.node_depths, dtype=np.int64))
        return _State(torch.from_numpy(np.ascontiguousarray(meta)), plan.tree_order.cpu().contiguous(),
                      pages.cpu().contiguous(), min(window or 0, _MAX_WINDOW), spec.logit_softcap or 0.0, row_pos,
                      depths, isa, spec.dtype == torch.bfloat16 and (self.pairs(isa) if pairs is None else pairs))

    def _run(self, q, k, v, state: _State, page_size: int, sm_scale: float, out, lse, sinks) -> None:
        self.extension.module().attention(q, k, v, state.meta, state.order, state.pages, page_size, sm_scale, out,
                                          lse, state.isa, state.window, state.softcap,
                                          _NONE if sinks is None else sinks, state.row_pos, state.depths, state.pairs)

    def tree_attention(self, q, k, v, plan, state: _State, *, sm_scale: float, out: torch.Tensor,
                       lse: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        self._run(q, k, v, state, 0, sm_scale, out, lse, sinks)

    def paged_tree_attention(self, q, kv, plan, state: _State, *, sm_scale: float, out: torch.Tensor,
                             lse: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        self._run(q, kv.k, kv.v, state, kv.page_size, sm_scale, out, lse, sinks)

    def merge_state(self, out_a, lse_a, out_b, lse_b, *, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.extension.module().merge_state(out_a, lse_a, out_b, lse_b, out, lse)
