"""Native C++ CPU kernel benchmark (issues 16 and 24), one command:

    python bench/native.py [--quick] [--threads N] [--clock wall|cpu] [--prefix 512 4096 16384] [--name native-zen3]

One tree-verification step of one request (h 32/8, d 128, a random tree of T nodes after P prefix
tokens), fp32, bf16 and fp16, timed in interleaved rounds (median) in the same run as SDPA ``enable_gqa``
with the tree mask and the ``cpu`` backend (PyTorch's flash kernel); each output is checked against the
first method's. Reports GFLOP/s (useful FLOPs, as ``treeattn bench`` counts them), the kernel path each
dtype runs on, this CPU's peaks measured in the same run by the kernel itself (the FMA loop and oneDNN's
brgemm micro-kernel per dtype, on the benchmark's threads), the share of the running path's peak, the
load average before and after, the CPU and its ISA, and evaluates the issue's targets. Writes
``bench/results/native[-<threads>t-<clock>].md/.json``.

On a machine shared with other work, ``--threads 1 --clock cpu`` times this process's CPU time on one
core: immune to other processes, but without the split across cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from treeattn.backends.native import NativeBackend
from treeattn.backends.native.build import EXTENSION
from treeattn.cli.bench_cpu import CLOCKS, DTYPES, Problem, _timed, bench_problem, build_method
from treeattn.cli.machine import load_average, machine_info

METHODS = ["native", "native-paged", "treeattn", "sdpa-gqa"]  # treeattn = the cpu backend
LABEL = {"native": "native", "native-paged": "native paged", "treeattn": "cpu backend", "sdpa-gqa": "SDPA gqa"}


def measure_peaks(threads: int, best_of: dict[str, float] | None = None) -> dict[str, float]:
    """This CPU's peaks in GFLOP/s on ``threads`` threads, measured by the kernel's own loops: the FMA
    kernel's (``fma``) and oneDNN's brgemm micro-kernel per dtype (absent where it has none); the best of
    5 runs each, and of ``best_of`` (an earlier measurement). The run measures before its cells and after
    each one and keeps the highest: on the machines here the AMX rate itself drifted by 2x over minutes
    (one core: 460-1335 GFLOP/s), so a peak read once could sit below what the cells ran at."""
    module = EXTENSION.module()
    fma = "fma-avx512" if "avx512" in NativeBackend().isas() else "fma-avx2"
    peaks = {"fma": max(module.peak(fma, 200_000, threads) for _ in range(5))}
    for dtype in DTYPES:
        with contextlib.suppress(RuntimeError):  # oneDNN has no micro-kernel for this dtype here
            peaks[f"brgemm-{dtype}"] = max(module.peak(f"brgemm-{dtype}", 50, threads) for _ in range(5))
    return {k: max(v, (best_of or {}).get(k, 0.0)) for k, v in peaks.items()}


def path_peak(dtype: str, path: str, peaks: dict[str, float]) -> float:
    """The peak of the code a dtype's kernel path spends its FLOPs in."""
    return peaks.get(f"brgemm-{dtype}", 0.0) if path.startswith("brgemm-") else peaks["fma"]


def paired_ratio(t: int, prefix: int, rounds: int, clock: str) -> dict:
    """Our fp32 call's time over our bf16 call's on one shape, the two calls interleaved in the same rounds
    (which goes first alternates): the table's cells are timed a minute or more apart, and on a shared
    machine the speed drifts between them by more than this target's margin (the cells' ratio at T 64,
    P 4096 ranged 1.71-2.06x over five runs of one hour on a Zen 5)."""
    timer = CLOCKS[clock]
    fns = {name: build_method("native", Problem(t, prefix, DTYPES[name])) for name in ("fp32", "bf16")}
    for name, fn in fns.items():
        if isinstance(fn, str):
            raise RuntimeError(f"native {name}: {fn}")
    for fn in fns.values():
        for _ in range(2):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32")):
            times[name].append(_timed(fns[name], timer)[0])
    per_round = sorted(f / b for f, b in zip(times["fp32"], times["bf16"]))
    return {"T": t, "P": prefix, "rounds": rounds,
            "ratio": statistics.median(times["fp32"]) / statistics.median(times["bf16"]),
            "round_min": per_round[0], "round_max": per_round[-1]}


def targets(rows: dict, peaks: dict, paths: dict, paired: dict | None = None) -> list[tuple[str, str, str]]:
    """Issue 24's targets as (target, worst measured value and where, met/missed)."""
    out = []

    def check(text, cells, value, goal):
        vals = [(value(c), where) for where, c in cells if value(c) is not None]
        if not vals:
            return
        worst, at = min(vals)
        out.append((text, f"worst {worst:.2f} at {at}", "met" if worst >= goal else "MISSED"))

    def ratio(c, base):
        return c[base] / c["native"] if c.get(base) and c.get("native") else None

    cells = sorted(rows.items())
    fmt = lambda k: f"{k[0]} T={k[1]} P={k[2]}"
    check(">= 1.3x SDPA enable_gqa at P >= 4096 (fp32, bf16)",
          [(fmt(k), c) for k, c in cells if k[0] in ("fp32", "bf16") and k[2] >= 4096], lambda c: ratio(c, "sdpa-gqa"), 1.3)
    check(">= 0.9x SDPA enable_gqa at P <= 512 (fp32, bf16)",
          [(fmt(k), c) for k, c in cells if k[0] in ("fp32", "bf16") and k[2] <= 512], lambda c: ratio(c, "sdpa-gqa"), 0.9)
    check("the default >= 0.95x the cpu backend (every dtype and shape)", [(fmt(k), c) for k, c in cells],
          lambda c: ratio(c, "treeattn"), 0.95)
    if paths.get("bf16", "").startswith("brgemm-"):  # this CPU has bf16 arithmetic that pays
        if paired:
            check("bf16 >= 2x our own fp32 at T 64, P 4096 (the two paired)", [("T=64 P=4096", paired)],
                  lambda c: c["ratio"], 2.0)
        check(">= 50% of the bf16 brgemm peak at T 64, P 4096",
              [(fmt(k), c) for k, c in cells if k == ("bf16", 64, 4096)],
              lambda c: c["gflops"] / peaks["brgemm-bf16"] if peaks.get("brgemm-bf16") else None, 0.5)
    elif "bf16" in paths:  # the two targets hold where the CPU has bf16 arithmetic that pays
        why = ("no bf16 arithmetic: oneDNN has no bf16 brgemm kernels on this CPU" if "brgemm-bf16" not in peaks
               else f"bf16 runs on `{paths['bf16']}` here")
        out.append(("bf16 >= 2x our own fp32 at T 64, P 4096", why + (f"; paired: {paired['ratio']:.2f}x" if paired else ""),
                    "not applicable here"))
        out.append((">= 50% of the bf16 brgemm peak at T 64, P 4096", why, "not applicable here"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T 8/64, P 512/4096, 3 repeats")
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16", "fp16"], choices=list(DTYPES))
    parser.add_argument("--T", nargs="+", type=int, default=[8, 26, 64, 128])
    parser.add_argument("--prefix", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", help="the results files' name (default native, or native-<threads>t-<clock>); "
                        "name another machine's run apart, e.g. native-zen3, so it keeps the committed ones")
    args = parser.parse_args()
    if args.quick:
        args.T, args.prefix, args.repeats = [8, 64], [512, 4096], 3
    torch.set_num_threads(args.threads)
    reason = EXTENSION.failure()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    info = machine_info()
    backend = NativeBackend()
    paths = {dtype: backend.path(DTYPES[dtype]) for dtype in args.dtype}
    info["native_paths"] = paths
    info["native_build_seconds"] = round(EXTENSION.build_seconds or 0.0, 1)
    print(f"{info['cpu']} ({', '.join(info['isa'])}), {args.threads} thread(s), native paths {paths}, "
          f"load {info['load_average_before']}", flush=True)
    peaks = measure_peaks(args.threads)
    print("peaks (GFLOP/s): " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()), flush=True)
    rows: dict[tuple[str, int, int], dict] = {}
    for dtype in args.dtype:
        for t in args.T:
            for prefix in args.prefix:
                problem = Problem(t, prefix, DTYPES[dtype])
                results = bench_problem(problem, METHODS, repeats=args.repeats, warmup=2, slow_repeats=1,
                                        slow_max_s=0.0, on_step=lambda s: None, clock=args.clock)
                cell = {r.method: r.median_ms for r in results}
                cell["gflops"] = next(r.gflops for r in results if r.method == "native")
                cell["max_abs_diff"] = max(r.max_abs_diff or 0.0 for r in results)
                rows[(dtype, t, prefix)] = cell
                peaks = measure_peaks(args.threads, best_of=peaks)
                print(f"{dtype} T={t:<3} P={prefix:<5} " + "  ".join(f"{LABEL[m]} {cell[m]:.3f} ms" for m in METHODS)
                      + f"  native {cell['gflops']:.1f} GFLOP/s", flush=True)
    paired = None
    if {"fp32", "bf16"} <= set(args.dtype):  # the target's shape, whatever the grid
        paired = paired_ratio(64, 4096, max(15, 3 * args.repeats), args.clock)
        print(f"bf16 vs own fp32 at T=64 P=4096, paired: {paired['ratio']:.2f}x", flush=True)
    info["load_average_after"] = load_average()
    met = targets(rows, peaks, paths, paired)
    name = args.name or ("native" if (args.threads, args.clock) == (torch.get_num_threads(), "wall") and args.threads == 2
                         else f"native-{args.threads}t-{args.clock}")
    lines = [f"# Native CPU kernel benchmark ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"CPU: {info['cpu']}, ISA {', '.join(info['isa'])}; {info['cores']} cores; {args.threads} thread(s); "
             "native kernel path per dtype (what `backend=None` runs): "
             + ", ".join(f"{d} `{p}`" for d, p in paths.items())
             + f" (extension built or loaded in {info['native_build_seconds']} s); torch {info['torch']}.",
             f"Load average (1/5/15 min) before {info['load_average_before']}, after {info['load_average_after']}"
             " (other processes shared the cores: compare ratios within a run, not absolute times).",
             f"Clock: {args.clock}; median of {args.repeats} interleaved rounds. Peaks measured in this run by the "
             f"kernel's own loops on {args.threads} thread(s), the best of before and after every cell: "
             + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peaks.items())
             + " (fma: the FMA kernel's vectors; brgemm-*: oneDNN's micro-kernel, 256 x 256 x 128 in cache).",
             "One request, h_q 32 / h_kv 8, d 128, random tree of T nodes after P prefix tokens; ragged token-major "
             "K/V (paged: 16-token TVM pages). x = method's time / native's time.", "",
             "| dtype | T | P | native ms | GFLOP/s | % of path's peak | native paged ms | cpu backend ms (x) | "
             "SDPA gqa ms (x) | vs own fp32 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (dtype, t, prefix), c in sorted(rows.items(), key=lambda kv: (list(DTYPES).index(kv[0][0]), kv[0][1], kv[0][2])):
        fp32 = rows.get(("fp32", t, prefix))
        vs = f"{fp32['native'] / c['native']:.2f}x" if dtype != "fp32" and fp32 else ""
        peak = path_peak(dtype, paths[dtype], peaks)
        share = f"{100 * c['gflops'] / peak:.0f}%" if peak else ""
        lines.append(f"| {dtype} | {t} | {prefix} | {c['native']:.3f} | {c['gflops']:.1f} | {share} | "
                     f"{c['native-paged']:.3f} | "
                     f"{c['treeattn']:.3f} ({c['treeattn'] / c['native']:.2f}x) | "
                     f"{c['sdpa-gqa']:.3f} ({c['sdpa-gqa'] / c['native']:.2f}x) | {vs} |")
    fp32_peak = path_peak("fp32", paths["fp32"], peaks) if "fp32" in paths else 0.0
    if paired:
        lines += ["", f"bf16 against our own fp32 at T {paired['T']}, P {paired['P']}, paired (the two calls "
                  f"interleaved in {paired['rounds']} rounds, which goes first alternating; the column above "
                  f"divides cells timed apart): {paired['ratio']:.2f}x (per-round ratios "
                  f"{paired['round_min']:.2f}-{paired['round_max']:.2f}x)"
                  + (f"; the peaks' ratio, bf16 micro-kernel over the fp32 path's: {peaks['brgemm-bf16'] / fp32_peak:.2f}x."
                     if peaks.get("brgemm-bf16") and fp32_peak else ".")]
    # A cell above its path's peak means the peak loop measured too low (as AVX2's did while its 16
    # accumulators spilled to the stack): say so, rather than print shares of a wrong peak.
    over = [f"{d} T={t} P={pr}" for (d, t, pr), c in rows.items()
            if path_peak(d, paths[d], peaks) and c["gflops"] > 1.05 * path_peak(d, paths[d], peaks)]
    if over:
        lines += ["", f"Warning: {', '.join(over)} ran above {'its' if len(over) == 1 else 'their'} path's measured "
                  "peak: that peak is wrong."]
        print(lines[-1], file=sys.stderr)
    lines += ["", "Targets (issue 24):", ""] + [f"- {s}: {t} ({w})" for t, w, s in met] + [""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines))
    (out / f"{name}.json").write_text(json.dumps({"machine": info, "peaks_gflops": peaks, "args": vars(args),
                                                  "results": {"/".join(map(str, k)): v for k, v in rows.items()},
                                                  "paired_bf16_over_fp32": paired, "targets": met}, indent=1) + "\n")
    print("\n".join(lines[-len(met) - 1:]))
    print(f"wrote {out / name}.md, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
