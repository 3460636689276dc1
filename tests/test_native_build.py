"""The native kernel's build cache across checkouts: one build per set of sources, never a rebuild loop."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

from treeattn.backends.native import build

LOAD = ("import sys; from pathlib import Path; from treeattn.backends.native.build import Extension, "
        "default_build_directory; e = Extension(csrc=Path(sys.argv[1])); e.module(); "
        "print(default_build_directory(Path(sys.argv[1])))")


def test_two_checkouts_of_the_same_sources_share_one_build_without_rebuilding(tmp_path):
    """Two source folders with the same sources (a development checkout and an installed copy) load in
    turn, each in a fresh process: after the first, none compiles and the module file is never rewritten
    (PyTorch's ninja file named the loading checkout's source paths, so each rebuilt the other's module,
    silently, 1-4 minutes a process)."""
    checkouts = [tmp_path / "checkout-a", tmp_path / "checkout-b"]
    for csrc in checkouts:
        shutil.copytree(build.CSRC, csrc)
    env = {k: v for k, v in os.environ.items() if k != "TREEATTN_NATIVE_ISA"}
    stamps = []
    for csrc in (*checkouts, *checkouts, checkouts[0]):
        run = subprocess.run([sys.executable, "-c", LOAD, str(csrc)], env=env, capture_output=True, text=True,
                             timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        if stamps:
            assert "compiling" not in run.stderr, f"loading from {csrc.name} compiled again:\n{run.stderr[-2000:]}"
        folder = run.stdout.split()[-1]
        modules = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".so")]
        assert len(modules) == 1
        stamps.append((folder, os.stat(modules[0]).st_mtime_ns))
    assert len(set(stamps)) == 1, f"the module was rebuilt: {stamps}"


def test_two_torch_installs_build_in_two_folders(monkeypatch):
    """Two environments with the same torch version (a venv and CI's) name their own headers and libraries
    in the build: they get a folder each instead of rebuilding each other's module in turn."""
    import torch

    here = build.default_build_directory()
    assert build.default_build_directory() == here
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert build.default_build_directory() != here


def test_the_kernel_builds_where_a_compiler_is():
    """Every native test skips when the build fails (a user without a compiler gets the cpu backend), so a
    broken build would pass unnoticed: on x86-64 Linux with a C++ compiler (CI's machines) it must build."""
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("needs x86-64 Linux with a C++ compiler")
    assert build.EXTENSION.failure() is None


def built_code() -> dict[str, list[tuple[int, str]]]:
    """The built module's machine code: each function's instructions as (address, text), by demangled
    signature (a template's leading "void " dropped), read with objdump; skips where it cannot be read."""
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not shutil.which("objdump"):
        pytest.skip("needs x86-64 Linux and objdump")
    if build.EXTENSION.failure():
        pytest.skip(build.EXTENSION.failure())
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", build.EXTENSION.module().__file__],
                             capture_output=True, text=True, check=True).stdout
    code: dict[str, list[tuple[int, str]]] = {}
    function = ""
    for line in listing.splitlines():
        if line.endswith(">:"):  # "<address> <signature>:" starts a function
            function = line.split("<", 1)[1][:-2].removeprefix("void ")
            code.setdefault(function, [])  # a name met twice (a namesake in another unit): both bodies
        elif function and (m := re.match(r"\s*([0-9a-f]+):\t(.*)", line)):
            code[function].append((int(m.group(1), 16), m.group(2)))
    return code


def test_native_prefetches_compiled_in():
    """GCC takes a function whose only effects are prefetches for one without effects and deletes the calls
    it does not inline: every call of prefetch_keys / prefetch_tile (the few-rows loops' next tile, the next
    work item's first keys) and the brgemm kernel's prefetch lambda was compiled out. The built module's
    code for each of them must hold prefetch instructions, on every kernel path."""
    code = built_code()
    prefetching = {f for f, instructions in code.items() if any(text.startswith("prefetch") for _, text in instructions)}

    def prefetches(name: str) -> bool:
        return any(signature.startswith(name + "(") for signature in prefetching)

    for isa in ("generic", "avx2", "avx512"):
        assert prefetches(f"treeattn_native::{isa}::run_rows<treeattn_native::{isa}::NoPairs>"), \
            f"{isa}'s few-rows loop prefetches nothing"
    assert prefetches("treeattn_native::avx512::run_rows<treeattn_native::avx512::Pairs16>"), \
        "the few-rows loop on bf16 pairs prefetches nothing"
    for isa in ("avx2", "avx512"):  # brgemm_item::run, or its one caller where the compiler inlined it there
        assert prefetches(f"treeattn_native::{isa}::brgemm_item::run") or prefetches(
            f"treeattn_native::run_item_brgemm_{isa}"), f"brgemm-{isa} prefetches nothing"
    assert prefetches("treeattn_native::(anonymous namespace)::run"), "the work-item loop prefetches nothing"


def test_micro_kernels_keep_their_accumulators_in_registers():
    """With its stores j outer, GCC 12 also stored every accumulator of a P V block it left out of line to a
    stack copy on each key, read only by the stores after the loop (the masked 2-vector block on AVX2; out of
    line and unmasked, the loop ran at a third of its in-register rate in a harness). No loop of the ISA
    paths' QK^T and P V blocks or panels left out of line (the FMA kernel's, and the bf16 pairs' P V blocks)
    may store a vector register to the stack (the portable path's 8-float structs do not fit SSE's 16
    registers: it spills by design)."""
    kernels = {f: instructions for f, instructions in built_code().items()
               if re.match(r"treeattn_native::(avx2|avx512)::(qk|pv)_(block|panel)<", f)}
    if not kernels:
        pytest.skip("the compiler inlined every QK^T and P V block: none to read on its own")
    for function, instructions in kernels.items():
        start = {address: i for i, (address, _) in enumerate(instructions)}
        # %rbp is the frame pointer only where the function sets it up; elsewhere it may address the output.
        stack = r"%rsp|%rbp" if any(t.replace(" ", "") == "mov%rsp,%rbp" for _, t in instructions) else r"%rsp"
        for i, (address, text) in enumerate(instructions):
            # A loop: a conditional branch back. Not jmp: the bf16 blocks jump back to a shared exit block.
            back = re.match(r"j(?!mp)[a-z]+\s+([0-9a-f]+) <", text)
            target = int(back.group(1), 16) if back else address
            if target < address and target in start:
                body = [t for _, t in instructions[start[target]:i + 1]]
                stores = [t for t in body if re.match(rf"v?mov\w*\s+%[yz]mm\d+,.*\(({stack})\)", t)]
                assert not stores, f"{function}: its loop stores vector registers to the stack: {stores[:4]}"
