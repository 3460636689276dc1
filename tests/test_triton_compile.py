"""The Triton kernels compile for sm_80 and sm_90 without a GPU, onto tensor cores, within shared memory.

Compilation runs in a subprocess (``python -m treeattn.backends.triton.aot``) with
``TRITON_INTERPRET`` removed: with it set, ``@triton.jit`` yields interpreted functions that
``triton.compile`` rejects ("'InterpretedFunction' object has no attribute 'cache_key'"), and
test_triton_interpreter.py sets it for the whole pytest process. The default test compiles the
CI subset (``aot.ci_variants``, 30 compiles, about a minute and a half on 2 idle cores); the ``slow``
one compiles every variant the backend can select (354 compiles, several minutes). Both include the
attention variants' constexpr flags (sliding window, soft-cap, sinks, together at the largest tile)
and MLA's head dims (K 576 as a 512 block plus a 64 tail, V a 512-dim view of K).

Decision on fp32 inputs: their dots run as exact fp32 FMA (``input_precision="ieee"``), matching
TVM's fp32 kernels to ~1e-6; TF32 would be faster but off by ~1e-3. So fp32 variants must show
FFMA and no tensor-core instruction; fp16/bf16 must show HMMA (sm_80) or HGMMA (sm_90 with a
64-row tile or more; smaller tiles use mma.sync, i.e. HMMA, there too), with no register spills.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

# Not pytest.importorskip: importing triton here, before test_triton_interpreter.py sets
# TRITON_INTERPRET, would fix triton in compiled mode for the whole process.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from treeattn.backends.triton.aot import ALL_VARIANTS, MLA_DIMS  # imports no triton (see above)

pytestmark = pytest.mark.triton


def compile_variants(tmp_path, *args) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "treeattn.backends.triton.aot", "--jobs", "2", "--json", str(out),
                           *args], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def check(results: list[dict]) -> None:
    assert results
    for r in results:
        where = f"{r['variant']} on sm_{r['arch']}"
        assert r["shared"] <= r["max_shared"], f"{where}: {r['shared']} B shared memory > {r['max_shared']}"
        if r["kernel"] != "attention":
            continue
        if r["dtype"] == "fp32":
            assert r["hmma"] == 0 and r["hgmma"] == 0 and r["ffma"] > 0, f"{where}: fp32 dots must be exact FMA"
        elif r["arch"] == 90 and r["tiles"]["block_m"] >= 64:
            assert r["hgmma"] > 0, f"{where}: expected warpgroup MMA (HGMMA)"
        else:
            assert r["hmma"] > 0, f"{where}: expected tensor-core MMA (HMMA)"
        # The tiles were chosen spill-free (partition.choose_tiles) for K and V with the same strides
        # (every engine layout but a V allocated unlike K). V's own address computation costs registers:
        # sm_90's 128-row tiles at d 80/128 spill 15-26 stores there (measured), so that path is exempt.
        if r["dtype"] != "fp32" and not r["own_v_strides"]:
            assert r["spill_stores"] == 0, f"{where}: {r['spill_stores']} register spill stores"


def test_ci_variants_compile_for_sm80_and_sm90(tmp_path):
    results = compile_variants(tmp_path, "--ci")
    check(results)
    assert {r["arch"] for r in results} == {80, 90}
    assert {r["kernel"] for r in results} == {"attention", "merge_splits", "merge_state", "rope"}
    assert any(r["own_v_strides"] and r["kernel"] == "attention" for r in results)  # the general V path
    attention = [r for r in results if r["kernel"] == "attention"]
    for arch in (80, 90):  # the variants' flags and MLA's dims, with and without them, on both targets
        assert any(set(r["variants"]) == set(ALL_VARIANTS) and r["head_dim"] == 128 for r in attention if r["arch"] == arch)
        mla = [r for r in attention if r["arch"] == arch and (r["head_dim"], r["v_head_dim"]) == MLA_DIMS]
        assert {bool(r["variants"]) for r in mla} == {False, True}
        assert any(r["kernel"] == "merge_splits" and r["variants"] == ["sinks"] and r["arch"] == arch for r in results)


@pytest.mark.slow
@pytest.mark.announce("compiling every Triton kernel variant for sm_80 and sm_90 (354 compiles, 5-10 minutes "
                      "on 2 cores)")
def test_every_variant_compiles(tmp_path):
    check(compile_variants(tmp_path))
