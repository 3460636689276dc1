"""Compile every kernel variant the dispatcher can select, for sm_80 and sm_90, without a GPU.

Run as ``python -m treeattn.backends.triton.aot [--arch 80 90] [--jobs 2] [--json FILE]``. It
must run where ``TRITON_INTERPRET`` is unset (it compiles real kernels; interpreted ones cannot
be compiled), hence a module of its own that tests start in a subprocess. For each variant it
reports the shared memory, register spills and the instruction mix of the SASS (``cuobjdump``
from the triton wheel): HMMA (sm_80 tensor cores), HGMMA (sm_90 warpgroup MMA), FFMA.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .dispatch import TileConfig, choose_tiles
from .launch import MERGE_BLOCK_H, MERGE_BLOCK_ROWS, ROPE_BLOCK_ROWS

MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes per block (opt-in maximum)
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
HEAD_DIMS = (64, 80, 128, 256)  # 80: the padded path (BLOCK_D 128)
ROWS = (1, 16, 32, 64, 128, 1024)  # qo_len * group values that reach every BLOCK_M the dispatcher picks


@dataclass(frozen=True)
class Variant:
    kernel: str  # attention | merge_splits | rope | merge_state
    dtype: str
    head_dim: int
    paged: bool = False
    tiles: TileConfig | None = None
    divide: bool = True  # rope: angle s / g (default/gptj/longrope) or s * g

    @property
    def name(self) -> str:
        t = self.tiles
        tiles = f"-m{t.block_m}n{t.block_n}w{t.num_warps}s{t.num_stages}" if t else ""
        extra = "-paged" if self.paged else ("-div" if self.kernel == "rope" and self.divide else "")
        return f"{self.kernel}-{self.dtype}-d{self.head_dim}{tiles}{extra}"


def dispatcher_variants(arch: int) -> list[Variant]:
    """Every compiled configuration ``choose_tiles`` and the launchers can produce on ``sm_{arch}``."""
    out = []
    for dtype, name in DTYPES.items():
        for d in HEAD_DIMS:
            for tiles in sorted({choose_tiles(dtype, d, rows, arch=arch) for rows in ROWS}, key=lambda t: t.block_m):
                out += [Variant("attention", name, d, paged, tiles) for paged in (False, True)]
            out.append(Variant("merge_splits", name, d))
            out += [Variant("rope", name, d, divide=div) for div in (True, False)]
            out.append(Variant("merge_state", name, d))
    return out


def ci_variants(arch: int) -> list[Variant]:
    """The subset CI compiles (20 compiles with both archs): the paged bf16 kernel at every head
    dim with its largest (most register- and shared-memory-hungry) tile, the smallest tile (no
    warpgroup MMA on sm_90), the ragged kernel, fp32, and each small kernel."""
    every = dispatcher_variants(arch)

    def pick(kernel, dtype, head_dim, paged=False, block_m=None, divide=True):
        found = [v for v in every if (v.kernel, v.dtype, v.head_dim, v.paged, v.divide) ==
                 (kernel, dtype, head_dim, paged, divide)]
        if block_m == "max":
            return max(found, key=lambda v: v.tiles.block_m)
        if block_m == "min":
            return min(found, key=lambda v: v.tiles.block_m)
        return found[0]

    chosen = [pick("attention", "bf16", d, True, "max") for d in HEAD_DIMS]
    chosen += [pick("attention", "fp16", 128, True, "min"), pick("attention", "fp16", 128, False, "max"),
               pick("attention", "fp32", 128, True, "max")]
    chosen += [pick("merge_splits", "bf16", 80), pick("merge_state", "fp16", 128), pick("rope", "bf16", 128)]
    return chosen


def _signature(v: Variant) -> tuple:
    """(kernel function, argument types, constexprs, num_warps, num_stages) for ``v``."""
    from . import kernels

    dt = f"*{v.dtype}"
    block_d = max(16, 1 << (v.head_dim - 1).bit_length())
    i32 = "i32"
    if v.kernel == "attention":
        t = v.tiles
        types = {"q_ptr": dt, "k_ptr": dt, "v_ptr": dt, "out_ptr": dt, "lse_ptr": "*fp32", "o_part_ptr": "*fp32",
                 "lse_part_ptr": "*fp32", "requests_ptr": "*i32", "work_ptr": "*i32", "counts_ptr": "*i32",
                 "tree_order_ptr": "*i32", "page_indices_ptr": "*i32", "qk_scale": "fp32"}
        for a in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_page",
                  "page_log2", "num_q_heads", "group"):
            types[a] = i32
        const = {"HEAD_DIM": v.head_dim, "PAGED": v.paged, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n,
                 "BLOCK_D": t.block_d, "FP32_DOT": t.fp32_dot}
        return kernels.tree_attn_kernel, types, const, t.num_warps, t.num_stages
    if v.kernel == "merge_splits":
        types = {"out_ptr": dt, "lse_ptr": "*fp32", "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32",
                 "requests_ptr": "*i32", "token_request_ptr": "*i32", "counts_ptr": "*i32", "num_q_heads": i32}
        const = {"HEAD_DIM": v.head_dim, "BLOCK_H": MERGE_BLOCK_H, "BLOCK_D": block_d}
        return kernels.merge_splits_kernel, types, const, 4, 1
    if v.kernel == "rope":
        types = {"x_ptr": dt, "pos_ptr": "*i32", "freq_ptr": "*fp32", "out_ptr": dt, "num_rows": i32,
                 "num_heads": i32, "stride_xt": i32, "stride_xh": i32, "rope_scale": "fp32", "rope_mult": "fp32"}
        const = {"HEAD_DIM": v.head_dim, "BLOCK_R": ROPE_BLOCK_ROWS, "BLOCK_D": block_d, "ROPE_DIVIDE": v.divide}
        return kernels.rope_kernel, types, const, 4, 1
    types = {"out_a_ptr": dt, "lse_a_ptr": "*fp32", "out_b_ptr": dt, "lse_b_ptr": "*fp32", "out_ptr": dt,
             "lse_ptr": "*fp32"}
    for a in ("num_rows", "num_heads", "stride_an", "stride_ah", "stride_bn", "stride_bh", "stride_lan",
              "stride_lah", "stride_lbn", "stride_lbh"):
        types[a] = i32
    const = {"HEAD_DIM": v.head_dim, "BLOCK_R": MERGE_BLOCK_ROWS, "BLOCK_D": block_d}
    return kernels.merge_state_kernel, types, const, 4, 1


def _sass(cubin: bytes) -> str:
    """Full SASS from the wheel's cuobjdump (``CompiledKernel.asm['sass']`` can come back partial)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def compile_variant(v: Variant, arch: int) -> dict:
    """Compile ``v`` for ``sm_{arch}`` and summarise what it became."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types, const, num_warps, num_stages = _signature(v)
    sig = dict(types)
    sig.update({k: "constexpr" for k in const})
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in types.items() if t.startswith("*")}
    start = time.perf_counter()
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                        target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    seconds = time.perf_counter() - start
    sass = _sass(ck.asm["cubin"])
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass, re.M)
    count = lambda op: sum(1 for o in ops if o == op)  # noqa: E731
    return {"variant": v.name, "arch": arch, "kernel": v.kernel, "dtype": v.dtype, "head_dim": v.head_dim,
            "tiles": asdict(v.tiles) if v.tiles else None, "shared": ck.metadata.shared,
            "max_shared": MAX_SHARED[arch], "spill_stores": count("STL"), "hmma": count("HMMA"),
            "hgmma": count("HGMMA"), "ffma": count("FFMA"), "instructions": len(ops), "seconds": round(seconds, 2)}


def _job(args):
    return compile_variant(*args)


def compile_all(variants_of, archs=(80, 90), jobs: int = 2) -> list[dict]:
    """Compile ``variants_of(arch)`` for each arch, ``jobs`` compilations at a time."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET to compile real kernels")
    todo = [(v, a) for a in archs for v in variants_of(a)]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_job, todo))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--kernel", nargs="*", help="only these kernels (attention, merge_splits, rope, merge_state)")
    parser.add_argument("--ci", action="store_true", help="only the CI subset (ci_variants)")
    parser.add_argument("--json", help="write the results here (default: print them)")
    args = parser.parse_args(argv)
    def variants_of(arch):
        chosen = ci_variants(arch) if args.ci else dispatcher_variants(arch)
        return [v for v in chosen if not args.kernel or v.kernel in args.kernel]

    results = compile_all(variants_of, args.arch, args.jobs)
    text = json.dumps(results, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
