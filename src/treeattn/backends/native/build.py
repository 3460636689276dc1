"""Build and load the native kernel: compiled from ``csrc/`` by PyTorch's extension machinery on first
use, cached under ``TORCH_EXTENSIONS_DIR`` in a folder named by a digest of the sources, flags and
torch version (so two checkouts or versions of treeattn never rebuild over each other's cache, or
wait on each other's build lock). The sources are copied into that folder once and compiled from
there: PyTorch's ninja file names the source paths, so two checkouts of the same sources compiling
from their own paths would each rewrite it and rebuild the other's module on every load. Builds of
one folder are serialised by an OS file lock, which dies with its process: PyTorch's own lock file,
left behind by a build that was killed, would otherwise make every later process wait forever. Every
compile is announced on stderr, with its duration. A failed build is reported once as a warning and
turns the backend unavailable, so dispatch falls back to the ``cpu`` backend."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("native.cpp", "brgemm.cpp", "kernel_generic.cpp", "kernel_avx2.cpp", "kernel_avx512.cpp")
# -fopenmp: at::parallel_for is an OpenMP region compiled into the extension; it links libgomp.so.1,
# which resolves to the copy torch has already loaded (one thread pool).
FLAGS = ["-O3", "-fopenmp"]


def default_build_directory(csrc: Path | None = None) -> str:
    """``<torch extensions root>/treeattn_native-<digest of csrc/, flags, torch version and install>``.
    The install (torch's folder) is in the digest since the build names its headers and libraries: two
    environments with the same torch version took turns rebuilding each other's module in one folder."""
    import torch
    from torch.utils import cpp_extension

    digest = hashlib.sha256(f"{FLAGS} {torch.__version__} {os.path.dirname(torch.__file__)}".encode())
    for path in sorted((csrc or CSRC).iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return os.path.join(root, f"treeattn_native-{digest.hexdigest()[:16]}")


@contextlib.contextmanager
def _exclusive(build_directory: str):
    """Hold the folder's build lock; a PyTorch lock file found then is stale (its builder died)."""
    with open(os.path.join(build_directory, "treeattn-build.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the OS if this process dies
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(build_directory, "lock"))
        yield


class Extension:
    """The compiled module, built at most once per process (thread-safe)."""

    def __init__(self, build_directory: str | None = None, csrc: Path | None = None):
        self.build_directory = build_directory
        self.csrc = csrc  # None: this package's csrc/
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
            csrc = self.csrc or CSRC
            build_directory = self.build_directory or default_build_directory(csrc)
            os.makedirs(build_directory, exist_ok=True)
            with _exclusive(build_directory):
                sources = _copy_sources(csrc, build_directory)
                compiling = not any(name.endswith(".so") for name in os.listdir(build_directory))
                if compiling:
                    print(f"treeattn: compiling the native CPU kernel into {build_directory} "
                          "(first use only, 1-4 minutes)", file=sys.stderr, flush=True)
                self._module = cpp_extension.load(
                    name="treeattn_native", sources=sources, extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                    build_directory=build_directory, verbose=False)
                if compiling:
                    print(f"treeattn: native CPU kernel compiled in {time.perf_counter() - start:.0f} s",
                          file=sys.stderr, flush=True)
        except Exception as exc:  # a missing or failing compiler: the cpu backend runs instead
            lines = str(exc).strip().splitlines() or ["no detail"]
            detail = next((line.strip() for line in lines if "error" in line.lower()), lines[-1])
            self._failure = (f"the native CPU kernel could not be built ({type(exc).__name__}: {detail}); "
                             "set CXX to a working C++17 compiler")
            warnings.warn(self._failure + "; falling back to the 'cpu' backend", RuntimeWarning, stacklevel=4)
        self.build_seconds = time.perf_counter() - start


def _copy_sources(csrc: Path, build_directory: str) -> list[str]:
    """The sources' copies in ``<build_directory>/src`` (written once: the folder's name is their digest,
    and a copy's unchanged mtime keeps ninja from rebuilding), as the paths to compile."""
    target = Path(build_directory, "src")
    target.mkdir(exist_ok=True)
    for path in csrc.iterdir():
        if path.is_file() and not (target / path.name).exists():
            shutil.copy2(path, target / (path.name + ".part"))
            os.replace(target / (path.name + ".part"), target / path.name)  # never a half-written source
    return [str(target / name) for name in SOURCES]


EXTENSION = Extension()
