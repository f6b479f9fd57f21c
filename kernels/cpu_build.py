"""Building the native CPU library: ``kernels/csrc/cpu_kernels.cpp`` compiled with the system C++
compiler, once per machine.

``build`` compiles the source (``$CXX``, else ``g++`` or ``c++``; ``-O3 -march=native -fopenmp``,
two to three seconds) into a cache directory (``$TIERSERVE_CACHE_DIR``, else
``~/.cache/tierserve``, else a temporary directory), under a name that hashes the source, the
compiler command and this CPU's feature flags, so machines of a Ray cluster that share a home
directory never load each other's builds. Concurrent builders take a file lock (one compiles, the
others load its build), and the compiler writes to a temporary file renamed into place
atomically. ``build_variant`` builds the source with other flags, for tests and benchmarks of
the paths other CPUs take. Loading a build is ``tierserve.kernels.cpu_native``'s.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
ENV_CACHE = "TIERSERVE_CACHE_DIR"
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c++17",
)


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else ``g++`` or ``c++``; None when there is none."""
    for cand in (os.environ.get("CXX"), "g++", "c++"):
        if cand and shutil.which(cand):
            return cand
    return None


@functools.cache
def cpuinfo(*keys: str) -> str:
    """The value of the first ``/proc/cpuinfo`` line starting with one of ``keys``, or what
    ``platform`` says of the CPU where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    """The CPU's feature flags, space-separated (``/proc/cpuinfo``'s ``flags``, ``Features`` on
    ARM; read once)."""
    return cpuinfo("flags", "Features")


def _cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get(ENV_CACHE):
        dirs.append(Path(os.environ[ENV_CACHE]))
    dirs.append(Path.home() / ".cache" / "tierserve")
    dirs.append(Path(tempfile.gettempdir()) / f"tierserve-{os.getuid()}")
    return dirs


def build(cxx: str) -> Path:
    """The library built from ``SOURCE`` by ``cxx`` for this CPU: the cached build when there is
    one, else compiled now (waiting for a concurrent builder instead where one holds the lock).
    Raises ``RuntimeError`` when no cache directory is writable or the compiler fails,
    ``OSError`` when the build cannot be written, ``subprocess.SubprocessError`` when it times
    out."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256()
    for part in (source, cxx.encode(), " ".join(FLAGS).encode(), cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    name = f"cpu_kernels-{key.hexdigest()[:16]}.so"
    errors = []
    for d in _cache_dirs():
        target = d / name
        if target.exists():
            return target
        try:
            d.mkdir(parents=True, exist_ok=True)
            lock = os.open(d / (name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            errors.append(f"{d}: {exc}")
            continue
        try:
            # Of two replicas starting at once on a fresh machine, one compiles and the other
            # waits for it, then loads its build (instead of compiling the same on the same cores).
            fcntl.flock(lock, fcntl.LOCK_EX)
            if target.exists():
                return target
            return _compile(cxx, target, name, d)
        finally:
            os.close(lock)  # releases the lock (the file stays: removing it would race)
    raise RuntimeError("no writable cache directory: " + "; ".join(errors))


def _compile(cxx: str, target: Path, name: str, d: Path) -> Path:
    """Build the library into ``target`` (through a temporary file in ``d``)."""
    fd, tmp = tempfile.mkstemp(prefix=name, suffix=".tmp", dir=d)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cxx, *FLAGS, str(SOURCE), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_variant(directory: Path, add: Sequence[str] = (), drop: Sequence[str] = ()) -> Path:
    """The source built with ``FLAGS`` less ``drop`` plus ``add`` (e.g. ``-march=x86-64`` for the
    portable loops, ``-mno-avx512f`` for the AVX2 path of an AVX-512 CPU) into ``directory``.
    Raises ``RuntimeError`` when there is no compiler or the build fails."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++ or c++)")
    flags = [f for f in FLAGS if f not in drop] + list(add)
    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    target = Path(directory) / f"cpu_kernels-variant-{tag}.so"
    proc = subprocess.run(
        [cxx, *flags, str(SOURCE), "-o", str(target)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{cxx} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return target
