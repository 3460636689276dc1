"""Compile every kernel variant the backend can select, for sm_80 and sm_90, without a GPU.

Run as ``python -m treeattn.backends.triton.aot [--arch 80 90] [--jobs 2] [--json FILE]``. It
must run where ``TRITON_INTERPRET`` is unset (it compiles real kernels; interpreted ones cannot
be compiled), hence a module of its own that tests start in a subprocess. For each variant it
reports the shared memory, register spills and the instruction mix of the SASS (``cuobjdump``
from the triton wheel): HMMA (sm_80 tensor cores), HGMMA (sm_90 warpgroup MMA), FFMA.

Each variant's kernel arguments come from the launcher's own ``*_launch`` function (``launch.py``),
called with small CPU tensors of the variant's dtypes: the argument list is never written here,
and each argument's Triton type is read off the value it gets. Attention variants take K and V as
two views of one page buffer, each with its own strides, as engines hand them over.
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

from .launch import Launch, attention_launch, merge_splits_launch, merge_state_launch, rope_launch
from .partition import TileConfig, choose_tiles

MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes per block (opt-in maximum)
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
TRITON_TYPES = {**DTYPES, torch.int32: "i32"}  # pointee types of tensor arguments
HEAD_DIMS = (64, 80, 128, 256)  # 80: the padded path (BLOCK_D 128)
MLA_DIMS = (576, 512)  # MLA's absorbed form: K 512 latent + 64 RoPE dims (a main block and a tail), V the latent
ALL_VARIANTS = ("sliding_window", "logit_softcap", "sinks")  # the attention variants' constexpr flags
ROWS = (1, 16, 32, 64, 128, 1024)  # qo_len * group values that reach every BLOCK_M the backend picks


@dataclass(frozen=True)
class Variant:
    kernel: str  # attention | merge_splits | rope | merge_state
    dtype: str
    head_dim: int
    paged: bool = False
    tiles: TileConfig | None = None
    divide: bool = True  # rope: angle s / g (default/gptj/longrope) or s * g
    own_v_strides: bool = False  # attention: V strided unlike K (the general address path)
    v_head_dim: int | None = None  # attention: V's own head dim, V a view of K's first dims (MLA); None: d
    variants: tuple[str, ...] = ()  # attention: sliding_window, logit_softcap, sinks; merge_splits: sinks

    @property
    def name(self) -> str:
        t = self.tiles
        tiles = f"-m{t.block_m}n{t.block_n}w{t.num_warps}s{t.num_stages}" if t else ""
        extra = "-paged" if self.paged else ("-div" if self.kernel == "rope" and self.divide else "")
        dims = f"d{self.head_dim}" + (f"v{self.v_head_dim}" if self.v_head_dim else "")
        flags = "".join(f"-{v}" for v in self.variants)
        return f"{self.kernel}-{self.dtype}-{dims}{tiles}{extra}{'-own-v' if self.own_v_strides else ''}{flags}"


def all_variants(arch: int) -> list[Variant]:
    """Every compiled configuration ``choose_tiles`` and the launchers can produce on ``sm_{arch}``."""
    out = []
    for dtype, name in DTYPES.items():
        for d in HEAD_DIMS:
            tile_set = sorted({choose_tiles(dtype, d, rows, arch=arch) for rows in ROWS}, key=lambda t: t.block_m)
            for tiles in tile_set:
                out += [Variant("attention", name, d, paged, tiles) for paged in (False, True)]
            # V strided unlike K (its own address computation): at the largest, most register-hungry tile
            out += [Variant("attention", name, d, paged, tile_set[-1], own_v_strides=True) for paged in (False, True)]
            # every variant at once (the most registers) at the largest tile
            out += [Variant("attention", name, d, paged, tile_set[-1], variants=ALL_VARIANTS) for paged in (False, True)]
            out += [Variant("merge_splits", name, d, variants=flags) for flags in ((), ("sinks",))]
            out += [Variant("rope", name, d, divide=div) for div in (True, False)]
            out.append(Variant("merge_state", name, d))
        d, d_v = MLA_DIMS
        tile_set = sorted({choose_tiles(dtype, d, rows, v_head_dim=d_v, arch=arch) for rows in ROWS},
                          key=lambda t: t.block_m)
        for tiles in tile_set:
            out += [Variant("attention", name, d, paged, tiles, v_head_dim=d_v) for paged in (False, True)]
        out += [Variant("attention", name, d, paged, tile_set[-1], v_head_dim=d_v, variants=ALL_VARIANTS)
                for paged in (False, True)]
        out.append(Variant("merge_splits", name, d_v, variants=("sinks",)))
    return out


def ci_variants(arch: int) -> list[Variant]:
    """The subset CI compiles (22 compiles with both archs): the paged bf16 kernel at every head
    dim with its largest (most register- and shared-memory-hungry) tile, the same with V strided
    unlike K (the general address path), the smallest tile (no warpgroup MMA on sm_90), the ragged
    kernel, fp32, and each small kernel."""
    every = all_variants(arch)

    def pick(kernel, dtype, head_dim, paged=False, block_m=None, divide=True, own_v_strides=False, v_head_dim=None,
             variants=()):
        found = [v for v in every if (v.kernel, v.dtype, v.head_dim, v.paged, v.divide, v.own_v_strides,
                                      v.v_head_dim, v.variants) ==
                 (kernel, dtype, head_dim, paged, divide, own_v_strides, v_head_dim, variants)]
        if block_m == "max":
            return max(found, key=lambda v: v.tiles.block_m)
        if block_m == "min":
            return min(found, key=lambda v: v.tiles.block_m)
        return found[0]

    chosen = [pick("attention", "bf16", d, True, "max") for d in HEAD_DIMS]
    chosen.append(pick("attention", "bf16", 128, True, "max", own_v_strides=True))
    chosen += [pick("attention", "fp16", 128, True, "min"), pick("attention", "fp16", 128, False, "max"),
               pick("attention", "fp32", 128, True, "max")]
    chosen += [pick("merge_splits", "bf16", 80), pick("merge_state", "fp16", 128), pick("rope", "bf16", 128)]
    # the attention variants' flags together, and MLA's head dims (plain and with every variant)
    d, d_v = MLA_DIMS
    chosen += [pick("attention", "bf16", 128, True, "max", variants=ALL_VARIANTS),
               pick("attention", "bf16", d, True, "max", v_head_dim=d_v),
               pick("attention", "fp16", d, False, "max", v_head_dim=d_v, variants=ALL_VARIANTS),
               pick("merge_splits", "bf16", d_v, variants=("sinks",))]
    return chosen


def _launch(v: Variant) -> Launch:
    """``v``'s launch, built by the launcher's own argument-list function from small CPU tensors."""
    dtype = next(t for t, name in DTYPES.items() if name == v.dtype)
    x = lambda *shape: torch.empty(shape, dtype=dtype)
    i32, f32 = torch.empty(1, dtype=torch.int32), torch.empty(1, 1, dtype=torch.float32)
    d = v.head_dim
    sinks = torch.empty(2, dtype=torch.float32) if "sinks" in v.variants else None
    if v.kernel == "attention":
        page_size = 16 if v.paged else 0
        shape = (2, page_size, 1, d) if v.paged else (2, 1, d)  # logical pages [P, page_size, h_kv, d] or ragged
        if v.v_head_dim:  # MLA: V a view of K's first dims
            k = x(*shape)
            v_ = k[..., :v.v_head_dim]
        elif v.own_v_strides:  # K on its own, V a view of a bigger buffer
            k, v_ = x(*shape), x(shape[0], 3, *shape[1:])[:, 1]
        else:  # K and V as views of one engine buffer [P, 2, ...]
            k, v_ = x(shape[0], 2, *shape[1:]).unbind(1)
        q = x(2, 2, d)
        out = x(2, 2, v_.shape[-1])
        return attention_launch(q, k, v_, out, f32, f32, f32, i32, i32, i32, i32, i32, i32, i32, sinks, sm_scale=1.0,
                                softcap=30.0 if "logit_softcap" in v.variants else 0.0,
                                window=8 if "sliding_window" in v.variants else 0, page_size=page_size, tiles=v.tiles,
                                grid_work=1)
    if v.kernel == "merge_splits":
        return merge_splits_launch(x(2, 2, d), f32, f32, f32, i32, i32, i32, sinks, grid_tokens=1)
    if v.kernel == "rope":
        return rope_launch(x(2, 2, d), i32, torch.empty(d), x(2, 2, d), scale=1.0, multiplier=1.0, divide=v.divide)
    return merge_state_launch(x(2, 2, d), f32, x(2, 2, d), f32, x(2, 2, d), f32)


def _signature(fn, args: dict) -> tuple[dict, dict]:
    """Triton argument types (``"*fp16"``, ``"i32"``, ``"fp32"``, ``"constexpr"``) and constexpr values."""
    types, constexprs = {}, {}
    for p in fn.params:
        value = args[p.name]
        if p.is_constexpr:
            types[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            types[p.name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            types[p.name] = "i1"
        elif isinstance(value, int):
            types[p.name] = "i32"
        else:
            types[p.name] = "fp32"
    return types, constexprs


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

    from . import kernels

    launch = _launch(v)
    fn = getattr(kernels, launch.kernel)
    types, const = _signature(fn, launch.args)
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in types.items() if t.startswith("*")}
    start = time.perf_counter()
    ck = triton.compile(ASTSource(fn=fn, signature=types, constexprs=const, attrs=attrs),
                        target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    seconds = time.perf_counter() - start
    sass = _sass(ck.asm["cubin"])
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass, re.M)
    count = lambda op: sum(1 for o in ops if o == op)
    return {"variant": v.name, "arch": arch, "kernel": v.kernel, "dtype": v.dtype, "head_dim": v.head_dim,
            "tiles": asdict(v.tiles) if v.tiles else None, "own_v_strides": v.own_v_strides,
            "v_head_dim": v.v_head_dim or v.head_dim, "variants": list(v.variants), "shared": ck.metadata.shared,
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
        chosen = ci_variants(arch) if args.ci else all_variants(arch)
        return [v for v in chosen if not args.kernel or v.kernel in args.kernel]

    results = compile_all(variants_of, args.arch, args.jobs)
    text = json.dumps(results, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
