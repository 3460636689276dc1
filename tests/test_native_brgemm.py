"""The native kernel's brgemm paths beyond tests/test_native*.py (which run every path this CPU has,
forced one at a time, on the CPU suite's cases): the self-check that switches a path off, a CPU that has
a dtype's oneDNN kernels passing it, oneDNN capped to lower ISAs (``ONEDNN_MAX_CPU_ISA`` only acts
before oneDNN initialises: subprocesses), and many threads on one brgemm shape (pytorch/pytorch#187912).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from tests.test_native import ISAS
from treeattn.backends import AttentionSpec
from treeattn.backends.native import NativeBackend
from treeattn.backends.native.build import EXTENSION

pytestmark = pytest.mark.skipif(EXTENSION.failure() is not None, reason=f"native kernel not built: {EXTENSION.failure()}")

BRGEMM = [isa for isa in ISAS if isa.startswith("brgemm-")]
FMA = next(isa for isa in ISAS if not isa.startswith("brgemm-")) if ISAS else None  # the self-check's baseline
ROOT = Path(__file__).resolve().parents[1]
FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
CAPPED = "ONEDNN_MAX_CPU_ISA" in os.environ or "DNNL_MAX_CPU_ISA" in os.environ


class Faulty:
    """The real extension, except that its brgemm paths raise or come out wrong: an injected failing path."""

    def __init__(self, mode: str):
        self.mode = mode
        self.real = EXTENSION.module()

    def failure(self):
        return None

    def module(self):
        return self

    def isas(self):
        return self.real.isas()

    def brgemm_16bit(self):
        return self.real.brgemm_16bit()

    def attention(self, q, k, v, meta, order, pages, page_size, sm_scale, out, lse, isa, *variants):
        if isa.startswith("brgemm-") and self.mode == "raise":
            raise RuntimeError("injected: no micro-kernel for this dtype")
        self.real.attention(q, k, v, meta, order, pages, page_size, sm_scale, out, lse, isa, *variants)
        if isa.startswith("brgemm-") and (self.mode == "wrong" or self.mode == "wrong dims-major" and k.stride(-1) != 1):
            out[0, 0, 0] += 1.0


@pytest.mark.skipif(not BRGEMM, reason="this CPU has no brgemm path (needs AVX2)")
@pytest.mark.parametrize("mode", ["raise", "wrong", "wrong dims-major"])
def test_a_failing_brgemm_path_is_switched_off_with_one_warning(mode):
    faulty = Faulty(mode)
    fallback = FMA
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert NativeBackend(extension=faulty).path(torch.float32) == fallback
        assert NativeBackend(extension=faulty).path(torch.float32) == fallback  # checked once per process
    assert len(caught) == len(BRGEMM), [str(w.message) for w in caught]  # one per path, none on the second ask
    why = "injected" if mode == "raise" else "differs from"
    for path, warning in zip(BRGEMM, caught):
        assert path in str(warning.message) and why in str(warning.message) and "float32" in str(warning.message)
        assert ("K dims-major" in str(warning.message)) == (mode == "wrong dims-major")
    spec = AttentionSpec(torch.device("cpu"), torch.float32, 8, 2, 64, 64)
    assert "self-check" in NativeBackend(isa=BRGEMM[0], extension=faulty).unsupported(spec)
    assert NativeBackend(extension=faulty).unsupported(spec) is None  # the default runs on the fallback


@pytest.mark.skipif(not BRGEMM, reason="this CPU has no brgemm path (needs AVX2)")
def test_a_dtype_torchs_brgemm_lacks_tries_no_brgemm_path_and_warns_of_nothing():
    """PyTorch's brgemm has no kernels for bf16 below AVX-512 (a Zen 3) nor fp16 without AVX512-FP16 (a Zen 4):
    that is expected, not a failure, so those dtypes run the FMA kernel without a check, a probe or a warning."""
    class No16Bit(Faulty):
        def brgemm_16bit(self):
            return []

    backend = NativeBackend(extension=No16Bit("raise"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.brgemm_dtypes() == [torch.float32]
        assert backend.path(torch.bfloat16) == FMA and backend.path(torch.float16) == FMA
    assert not [key for key in NativeBackend._checks if key[0] is backend.extension]  # never checked


def expected_brgemm_dtypes() -> list[torch.dtype]:
    """The dtypes oneDNN has brgemm kernels for on this CPU (torch 2.13's CPUBlas.cpp: fp32 from AVX2; bf16
    in VNNI layout from AVX-512, natively with AVX512-BF16 or AMX; fp16 with AVX512-FP16 (B read plain) or
    AMX-FP16 (B in VNNI pairs): the kernel probes which)."""
    dtypes = [torch.float32]
    if FLAGS & {"avx512_bf16", "amx_bf16"}:
        dtypes.append(torch.bfloat16)
    if FLAGS & {"avx512_fp16", "amx_fp16"}:
        dtypes.append(torch.float16)
    return dtypes


@pytest.mark.skipif(not FLAGS, reason="no /proc/cpuinfo to compare with")
def test_brgemm_dtypes_are_what_torchs_brgemm_takes_on_this_cpu():
    """float32 from AVX2, bfloat16 from AVX-512 (emulated without AVX512-BF16), float16 from AVX512-FP16."""
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= FLAGS
    want = ([torch.float32] + [torch.bfloat16] * avx512 + [torch.float16] * (avx512 and "avx512_fp16" in FLAGS))
    assert NativeBackend().brgemm_dtypes() == want
    assert set(expected_brgemm_dtypes()) <= set(want)  # the dtypes whose kernels must pass their check are tried


@pytest.mark.skipif(not BRGEMM or CAPPED, reason="no brgemm path, or oneDNN's ISA is capped in this process")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_brgemm_kernels_this_cpu_has_pass_their_check(dtype):
    """A dtype's brgemm path is off only where oneDNN lacks its kernels: a CPU that has them must not
    silently skip every brgemm test (tests/test_native*.py skip a path whose check fails)."""
    if dtype not in expected_brgemm_dtypes():
        pytest.skip(f"oneDNN has no {dtype} brgemm kernels on this CPU (what it needs: expected_brgemm_dtypes)")
    for isa in BRGEMM:
        assert NativeBackend().check(isa, dtype) is None
    backend = NativeBackend()
    assert backend.path(dtype) == (BRGEMM[0] if backend.pays(BRGEMM[0], dtype) else FMA)


@pytest.mark.skipif(not BRGEMM or CAPPED, reason="no brgemm path, or oneDNN's ISA is capped in this process")
def test_a_brgemm_path_is_the_default_only_where_it_pays(monkeypatch):
    """The default takes a brgemm path only where it runs the probe's tree steps >= 1.05x as fast as the FMA
    kernel; a forced path runs either way. AMX's bf16 tiles must pay (2.5-5x measured on a Sapphire Rapids)."""
    backend = NativeBackend()
    brgemm, fma = backend.speed(BRGEMM[0], torch.float32)
    assert fma > 1.0 and brgemm > 1.0  # real measurements, GFLOP/s
    if "amx_bf16" in FLAGS:
        assert backend.pays(BRGEMM[0], torch.bfloat16) and backend.path(torch.bfloat16) == BRGEMM[0]
    monkeypatch.setattr(backend, "speed", lambda isa, dtype: (100.0, 96.0))
    assert backend.path(torch.float32) == FMA  # float32: the dtype every brgemm CPU takes
    monkeypatch.setattr(backend, "speed", lambda isa, dtype: (106.0, 100.0))
    assert backend.path(torch.float32) == BRGEMM[0]
    forced = NativeBackend(isa=BRGEMM[0])
    monkeypatch.setattr(forced, "speed", lambda isa, dtype: (1.0, 90.0))
    assert forced.path(torch.float32) == BRGEMM[0]


def run_python(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a crash there fails the test instead of killing pytest)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(not BRGEMM, reason="this CPU has no brgemm path (needs AVX2)")
@pytest.mark.parametrize("cap", ["AVX2", "AVX512_CORE", "AVX512_CORE_BF16"])
def test_brgemm_paths_under_a_capped_onednn(cap):
    """oneDNN capped to a lower ISA (the paths a smaller CPU runs: AVX2 as a Zen 3, AVX512_CORE_BF16 as a
    Zen 4, whose bf16 kernels are not AMX's): every brgemm path and dtype either passes the suite's cases
    against the float64 reference or is switched off by its check and skipped."""
    if cap.startswith("AVX512_CORE") and not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= FLAGS:
        pytest.skip("this CPU has no AVX-512")
    if cap == "AVX512_CORE_BF16" and "avx512_bf16" not in FLAGS:
        pytest.skip("this CPU has no AVX512-BF16")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k",
                             "brgemm and (mixed_batch or variants_every_path or split)",
                             "tests/test_native.py", "tests/test_native_variants.py"],
                            cwd=ROOT, env={**os.environ, "ONEDNN_MAX_CPU_ISA": cap}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout
    if cap == "AVX2":  # no 16-bit kernels below AVX-512: bf16 is switched off, fp32 runs
        assert "skipped" in result.stdout


@pytest.mark.skipif(not BRGEMM, reason="this CPU has no brgemm path (needs AVX2)")
def test_many_threads_on_one_brgemm_shape():
    """pytorch/pytorch#187912 (segfaults with many threads calling AMX brgemm on one shape): 4 Python threads
    at once, each a call whose prefix is split across 16 OpenMP threads (oversubscribed), every dtype whose
    check passes, every result checked against the FMA kernel's. In a subprocess: a crash fails the test."""
    result = run_python(f"""
        import threading, torch, warnings
        warnings.simplefilter("ignore")
        from treeattn.backends import AttentionSpec
        from treeattn.backends.native import NativeBackend
        from treeattn.plan import TreeAttentionPlan
        from treeattn.testing import Request, binary, make_batch
        torch.set_num_threads(16)
        errors = []
        def worker(seed, isa, dtype):
            try:
                batch = make_batch([Request(binary(31), prefix=3000, qo=20)], h_q=8, h_kv=1, d=128, dtype=dtype, seed=seed)
                plan = TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
                spec = AttentionSpec(torch.device("cpu"), dtype, 8, 1, 128, 128)
                outs = []
                for name in (isa, "{FMA}"):
                    backend = NativeBackend(isa=name)
                    state = backend.plan(plan, spec)
                    for _ in range(10 if name == isa else 1):
                        out = torch.full_like(batch.q, float("nan"))
                        lse = torch.full(batch.q.shape[:2], float("nan"))
                        backend.tree_attention(batch.q, batch.k, batch.v, plan, state, sm_scale=0.088, out=out, lse=lse)
                        outs.append(out.float())
                tol = 2e-5 if dtype == torch.float32 else 3e-2
                for out in outs[:-1]:
                    torch.testing.assert_close(out, outs[-1], atol=tol, rtol=tol)
            except Exception as exc:
                errors.append(repr(exc))
        jobs = [(isa, dtype) for isa in {BRGEMM!r} for dtype in (torch.float32, torch.bfloat16, torch.float16)
                if NativeBackend().check(isa, dtype) is None]
        threads = [threading.Thread(target=worker, args=(i, *jobs[i % len(jobs)])) for i in range(4 * len(jobs))]
        for t in threads: t.start()
        for t in threads: t.join()
        assert not errors, errors
        print("ok", len(threads), "calls of", jobs)
    """, {}, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])


@pytest.mark.skipif(not BRGEMM, reason="this CPU has no brgemm path (needs AVX2)")
def test_peaks_count_the_flops_they_ran():
    """bench/native.py's peaks. The FMA loop of the widest vectors here reaches at least 0.9x oneDNN's fp32
    micro-kernel, which runs on the same FMA units (measured 1.02x on a Zen 4, 1.06x Zen 5, 1.24x Sapphire
    Rapids, 1.1-1.4x on one Zen 3 thread); the loop that spilled its accumulators to the stack read 0.64-0.78x
    there. Best of 3, the two interleaved, so a burst of load on a shared machine hits both. A kind this CPU lacks or an unknown one
    is an error naming it."""
    module = EXTENSION.module()
    fma = "fma-avx512" if "avx512" in ISAS else "fma-avx2"
    rates: dict[str, float] = {}
    for _ in range(3):
        for kind, iters in ((fma, 2_000_000), ("brgemm-fp32", 50)):
            rates[kind] = max(rates.get(kind, 0.0), module.peak(kind, iters, 1))
    assert rates[fma] >= 0.9 * rates["brgemm-fp32"] > 0, rates
    if "avx512" not in ISAS:
        with pytest.raises(RuntimeError, match="fma-avx512 is not available"):
            module.peak("fma-avx512", 10, 1)
    with pytest.raises(RuntimeError, match="unknown peak kind fma-avx3"):
        module.peak("fma-avx3", 10, 1)
