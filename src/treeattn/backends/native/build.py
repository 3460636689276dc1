"""Build and load the native kernel: compiled from ``csrc/`` by PyTorch's extension machinery on first
use (cached under ``TORCH_EXTENSIONS_DIR``, rebuilt when a source changes). A failed build is reported
once as a warning and turns the backend unavailable, so dispatch falls back to the ``cpu`` backend."""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("native.cpp", "kernel_generic.cpp", "kernel_avx2.cpp")
# -fopenmp: at::parallel_for is an OpenMP region compiled into the extension; it links libgomp.so.1,
# which resolves to the copy torch has already loaded (one thread pool).
FLAGS = ["-O3", "-fopenmp"]


class Extension:
    """The compiled module, built at most once per process (thread-safe)."""

    def __init__(self, build_directory: str | None = None):
        self.build_directory = build_directory
        self.build_seconds: float | None = None
        self._module = None
        self._failure: str | None = None
        self._lock = threading.Lock()

    def failure(self) -> str | None:
        """Why the module cannot be used (its build failed), or None once it is loaded."""
        self._ensure()
        return self._failure

    def module(self):
        self._ensure()
        if self._failure:
            raise RuntimeError(self._failure)
        return self._module

    def _ensure(self) -> None:
        with self._lock:
            if self._module is None and self._failure is None:
                self._build()

    def _build(self) -> None:
        from torch.utils import cpp_extension

        start = time.perf_counter()
        try:
            if self.build_directory:
                os.makedirs(self.build_directory, exist_ok=True)
            self._module = cpp_extension.load(
                name="treeattn_native", sources=[str(CSRC / s) for s in SOURCES], extra_cflags=FLAGS,
                extra_ldflags=["-fopenmp"], build_directory=self.build_directory, verbose=False)
        except Exception as exc:  # a missing or failing compiler: the cpu backend runs instead
            lines = str(exc).strip().splitlines() or ["no detail"]
            detail = next((line.strip() for line in lines if "error" in line.lower()), lines[-1])
            self._failure = (f"the native CPU kernel could not be built ({type(exc).__name__}: {detail}); "
                             "set CXX to a working C++17 compiler")
            warnings.warn(self._failure + "; falling back to the 'cpu' backend", RuntimeWarning, stacklevel=4)
        self.build_seconds = time.perf_counter() - start


EXTENSION = Extension()
