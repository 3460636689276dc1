"""The machine a benchmark ran on, in words: results files name it, since the project's machines differ
(AVX2-only Zen 3, AVX512-BF16 Zen 4 and Zen 5, AMX Sapphire Rapids have all been seen) and a figure
means little without the CPU behind it. ``/proc/cpuinfo`` gives the vendor's model name, which on
cloud machines is often just "AMD EPYC"; the family and model numbers say which core it is."""

from __future__ import annotations

import os
import platform

import torch

# (vendor, family, first model, last model) -> core; the x86 family/model numbers the vendors publish.
_CORES = [
    ("AuthenticAMD", 0x17, 0x00, 0xFF, "Zen / Zen 2"),
    ("AuthenticAMD", 0x19, 0x00, 0x0F, "Zen 3"), ("AuthenticAMD", 0x19, 0x20, 0x2F, "Zen 3"),
    ("AuthenticAMD", 0x19, 0x40, 0x5F, "Zen 3"),
    ("AuthenticAMD", 0x19, 0x10, 0x1F, "Zen 4"), ("AuthenticAMD", 0x19, 0x60, 0x7F, "Zen 4"),
    ("AuthenticAMD", 0x19, 0xA0, 0xAF, "Zen 4"),
    ("AuthenticAMD", 0x1A, 0x00, 0xFF, "Zen 5"),
    ("GenuineIntel", 6, 0x55, 0x55, "Skylake/Cascade Lake"), ("GenuineIntel", 6, 0x6A, 0x6C, "Ice Lake"),
    ("GenuineIntel", 6, 0x8F, 0x8F, "Sapphire Rapids"), ("GenuineIntel", 6, 0xCF, 0xCF, "Emerald Rapids"),
    ("GenuineIntel", 6, 0xAD, 0xAE, "Granite Rapids"),
]
# The flags that decide which kernel paths can run, in the words the docs use.
_ISA = [("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("avx512_fp16", "AVX512-FP16"),
        ("amx_bf16", "AMX-BF16"), ("amx_fp16", "AMX-FP16")]


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def isa_flags(fields: dict[str, str] | None = None) -> list[str]:
    """The kernel-relevant ISA extensions this CPU reports, e.g. ``["AVX2", "AVX-512", "AVX512-BF16"]``."""
    flags = set((cpuinfo() if fields is None else fields).get("flags", "").split())
    return [name for flag, name in _ISA if flag in flags]


def core_name(fields: dict[str, str] | None = None) -> str | None:
    """The core's name from the vendor, family and model (``"Zen 5"``), or None when unknown."""
    fields = cpuinfo() if fields is None else fields
    try:
        family, model = int(fields.get("cpu family", "")), int(fields.get("model", ""))
    except ValueError:
        return None
    vendor = fields.get("vendor_id")
    return next((name for v, f, lo, hi, name in _CORES if v == vendor and f == family and lo <= model <= hi), None)


def describe_cpu() -> str:
    """E.g. ``"AMD EPYC (Zen 5; AVX2, AVX-512, AVX512-BF16), 2 cores"``."""
    fields = cpuinfo()
    name = fields.get("model name") or platform.processor() or platform.machine()
    details = "; ".join(part for part in (core_name(fields), ", ".join(isa_flags(fields))) if part)
    return f"{name}{f' ({details})' if details else ''}, {os.cpu_count()} cores"


def load_average() -> list[float] | None:
    """1/5/15-minute load average: other processes on the machine make every number slower."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict:
    """What a results file records of the machine: the CPU (name and core), its ISA flags, cores, torch's
    threads and build, and the load average now (``load_average_before``)."""
    fields = cpuinfo()
    flags = set(fields.get("flags", "").split())
    isa = [name for name in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16") if name in flags]
    name, core = fields.get("model name") or platform.processor() or platform.machine(), core_name(fields)
    return {"cpu": f"{name} ({core})" if core else name, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average_before": load_average(),
            "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa": isa, "python": platform.python_version()}
