"""``treeattn check``: every backend that can run on the device against the float64 reference (the
``reference`` backend) on fresh random cases; it names the backends it skips and why (on a CPU:
Triton, which needs CUDA; the test suite checks its kernels under Triton's interpreter). On a CPU it
also checks every path of the native kernel this CPU has (brgemm on oneDNN's micro-kernels, the FMA
kernel per ISA), each dtype forced onto it, and says which one each dtype runs by default and why a path
is off: what differs from machine to machine (AVX2, AVX-512, AVX512-BF16/FP16, AMX)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import ops
from ..backends import BACKENDS, AttentionSpec, Backend, available_backends, get_backend
from ..rope import RoPE
from ..testing import LSE_RTOL, MIXED, TOL, Request, binary, chain, forest, make_batch, poisoned, star

CASES = [
    # name, requests, dtype, page size (None: ragged), rope
    ("ragged mixed batch", MIXED, torch.float32, None, None),
    ("ragged fp16", MIXED, torch.float16, None, None),
    ("ragged bf16", MIXED, torch.bfloat16, None, None),
    ("ragged + llama3 RoPE", [Request(binary(15)), Request(forest(chain(4), star(5)))], torch.float32, None,
     RoPE(5e5, 1.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64})),
    ("paged, page 16, long prefix", [Request(binary(26), prefix=700, qo=20), *MIXED], torch.float32, 16, None),
    ("paged, page 1, fp16", MIXED, torch.float16, 1, None),
]


@dataclass
class Result:
    backend: str
    case: str
    out_err: float
    lse_err: float
    ok: bool


def _run(backend: str | Backend, name: str, requests, dtype, page_size, rope, device, label: str | None = None) -> Result:
    batch = make_batch(requests, h_q=8, h_kv=2, d=64, dtype=dtype, seed=zlib.crc32(name.encode()),
                       page_size=page_size, device=device)
    kwargs = {}
    if rope is not None:
        kwargs = dict(rope=rope, q_positions=torch.randint(0, 4000, (batch.q.shape[0],), device=device, dtype=torch.int32))
    results = []
    for which in ("reference", backend):
        out, lse = poisoned(batch.q), poisoned(batch.q, batch.q.shape[:2], torch.float32)
        if page_size is None:
            ops.tree_attention(*batch.ragged_args(), out=out, lse=lse, backend=which, **kwargs)
        else:
            ops.paged_tree_attention(*batch.paged_args(), out=out, lse=lse, backend=which)
        results.append((out.float().cpu(), lse.cpu()))
    (ref_out, ref_lse), (out, lse) = results
    atol, rtol = TOL[dtype]
    out_err = (out - ref_out).abs().max().item()
    lse_err = ((lse - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)).max().item()
    ok = bool(torch.isfinite(out).all() and torch.allclose(out, ref_out, atol=atol, rtol=rtol) and lse_err <= LSE_RTOL)
    return Result(label or str(backend), name, out_err, lse_err, ok)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _native_paths(results: list[Result]) -> Table:
    """The native kernel's paths on this CPU, each dtype forced onto each (the cases of that dtype, their
    results added to ``results``): the worst output error, the default path per dtype, why a path is off."""
    from ..backends.native import NativeBackend
    from .machine import describe_cpu

    native = NativeBackend()
    dtypes = list(dict.fromkeys(case[2] for case in CASES))
    table = Table("path", *map(_dtype_name, dtypes), title=f"native kernel paths on this CPU: {describe_cpu()}")
    for isa in native.isas():
        cells = []
        for dtype in dtypes:
            why = native.off(isa, dtype)
            if why:
                cells.append(f"[yellow]off[/]: {escape(why)}")  # an exception's text may hold brackets
                continue
            mine = [_run(NativeBackend(isa=isa), name, requests, dtype, page_size, rope, "cpu", label=f"native {isa}")
                    for name, requests, case_dtype, page_size, rope in CASES if case_dtype == dtype]
            results.extend(mine)
            ok = all(r.ok for r in mine)
            cells.append(f"{'[green]ok[/]' if ok else '[red]FAIL[/]'} {max(r.out_err for r in mine):.1e}"
                         + (" [bold](default)[/]" if native.path(dtype) == isa else ""))
        table.add_row(isa, *cells)
    return table


def run_check(device: str = "cpu", console: Console | None = None) -> int:
    """Print a table of errors per backend and case; return a process exit code (0 = all pass)."""
    console = console or Console()
    device = torch.device(device)
    backends = [b for b in available_backends(device) if b != "reference"]
    console.print(f"treeattn check on [bold]{device}[/] with torch {torch.__version__}: backends {', '.join(backends)} "
                  "against the float64 reference")
    spec = AttentionSpec(device, torch.float32, 2, 1, 64, 64)
    for name in BACKENDS:
        if name not in backends and name != "reference":
            backend = get_backend(name)
            console.print(f"  skipped {name}: {backend.unavailable() or backend.unsupported(spec)}")
    table = Table("backend", "case", "dtype", "max |Δout|", "max rel |Δlse|", "status")
    results = []
    for backend in backends:
        for name, requests, dtype, page_size, rope in CASES:
            r = _run(backend, name, requests, dtype, page_size, rope, device)
            results.append(r)
            table.add_row(backend, name, _dtype_name(dtype), f"{r.out_err:.2e}", f"{r.lse_err:.2e}",
                          "[green]ok[/]" if r.ok else "[red]FAIL[/]")
    console.print(table)
    if device.type == "cpu" and "native" in backends:
        console.print(_native_paths(results))
    failed = [r for r in results if not r.ok]
    if failed:
        console.print(f"[red]{len(failed)} of {len(results)} checks failed[/]")
        return 1
    tolerances = ", ".join(f"{_dtype_name(dtype)} {atol:g}" for dtype, (atol, _) in TOL.items())
    console.print(f"[green]all {len(results)} checks passed[/] (tolerances: {tolerances}; LSE {LSE_RTOL:g} rel)")
    return 0
