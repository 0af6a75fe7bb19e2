"""Build a C source of this package once per machine and load it with ctypes.

The library is built with the system's C compiler (``cc``, or ``$CC``) into the kvcmas cache; no Python
headers or torch build are needed. ``CLibrary.load`` returns it, or None with the reason in
``unavailable()`` when there is no compiler or the build fails, so callers serve from torch and say so.

Where torch runs its threads on GNU OpenMP (libgomp, already loaded by torch) and the compiler is GCC,
the source is built with -fopenmp: the library then links the same libgomp by its soname, so its
parallel regions use torch's own thread team, as many threads as ``torch.get_num_threads()``.
Elsewhere it runs on one thread, and ``one_thread`` says why.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared"]
# -fopenmp-simd honours the source's `omp simd` pragmas without linking an OpenMP runtime: a second
# OpenMP runtime beside torch's would make every parallel region of the process sleep and wake.
SINGLE, SHARED = "-fopenmp-simd", "-fopenmp"


def cache_dir() -> Path:
    """<the kvcmas cache>/kernels: $KVCMAS_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache, then kvcmas."""
    env = os.environ.get("KVCMAS_CACHE_DIR")
    root = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcmas"
    return root.expanduser() / "kernels"


def cpu() -> str:
    """What -march=native builds for: a library built on one CPU is not loaded on another that shares
    the cache."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    return cc


def gomp_paths() -> set[str]:
    """The GNU OpenMP runtimes mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}


def threading_reason(cc: str) -> str | None:
    """None when a library can share torch's OpenMP team, else why it runs on one thread."""
    if not sys.platform.startswith("linux"):
        return f"threads are shared with torch on Linux only, not {sys.platform}"
    if "OpenMP" not in torch.__config__.parallel_info().split("parallel backend:")[-1]:
        return "torch's parallel backend is not OpenMP"
    if len(gomp_paths()) != 1:
        return "torch's OpenMP runtime is not one libgomp"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cc} --version failed: {exc}"
    if "Free Software Foundation" not in version:
        return f"{cc} is not GCC (its OpenMP runtime would not be torch's libgomp)"
    return None


def build(sources: tuple[Path, ...], target: Path, cc: str, flags: list[str]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:      # build aside, then rename: atomic
        out = Path(tmp) / target.name
        done = subprocess.run([cc, *flags, *map(str, sources), "-o", str(out), "-lm"], capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, target)


def built(sources: tuple[Path, ...], cc: str, flags: list[str]) -> Path:
    """The library of ``sources`` (and the headers beside them) built with these flags, building it unless
    the cache has it."""
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    key = hashlib.sha256(b"".join(p.read_bytes() for p in (*sources, *headers)) + " ".join(flags).encode()
                         + cpu().encode())
    target = cache_dir() / f"{sources[0].stem}-{key.hexdigest()[:12]}.so"
    if not target.exists():
        build(sources, target, cc, flags)
    return target


class CLibrary:
    """C sources built into one library and loaded on first use; ``signatures`` maps each function to its
    ctypes argument types (all return void). ``disable_env`` names a variable that, when set, keeps it
    unloaded."""

    def __init__(self, sources: Path | tuple[Path, ...], signatures: dict[str, list], disable_env: str, what: str,
                 extra_flags: tuple[str, ...] = ()):
        self.sources = (sources,) if isinstance(sources, Path) else tuple(sources)
        self.signatures, self.disable_env, self.what = signatures, disable_env, what
        self.extra_flags = list(extra_flags)
        self.shared = SHARED
        self.threading = threading_reason
        self.reset()

    def reset(self) -> None:
        """Forget the loaded library, so the next ``load`` tries again (tests)."""
        self.lib: ctypes.CDLL | None = None
        self.why: str | None = None
        self.one_thread: str | None = None
        self.tried = False

    def load(self) -> ctypes.CDLL | None:
        """The built library (building it on first use), or None when it cannot be built here."""
        if self.tried:
            return self.lib
        self.tried = True
        if os.environ.get(self.disable_env):
            self.why = f"{self.disable_env} is set"
            return None
        try:
            cc = compiler()
            one = self.threading(cc)
            flags = [*FLAGS, *self.extra_flags]
            try:
                target = built(self.sources, cc, [*flags, SINGLE if one else self.shared])
            except RuntimeError as exc:      # e.g. no libgomp to link against: one thread, still compiled
                if one:
                    raise
                one, target = f"the -fopenmp build failed: {exc}", built(self.sources, cc, [*flags, SINGLE])
            before = gomp_paths()
            lib = ctypes.CDLL(str(target))
            if not one and gomp_paths() != before:       # a runtime of its own, not torch's
                one = "the library loaded a second libgomp"
            for name, args in self.signatures.items():
                getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
        except Exception as exc:             # no compiler, a failed build, an unloadable library
            self.why = f"{self.what} unavailable: {exc}"
            return None
        self.lib, self.one_thread = lib, one
        return lib

    def flag(self, name: str) -> bool:
        """What the library's ``int name(void)`` says (how it was built), False when it is not loaded."""
        lib = self.load()
        if lib is None:
            return False
        getattr(lib, name).restype = ctypes.c_int
        return bool(getattr(lib, name)())

    def threads(self) -> int:
        """How many threads its parallel regions ask for: torch's, where they share its team."""
        return 1 if self.one_thread else torch.get_num_threads()

    def unavailable(self) -> str | None:
        """Why ``load`` returned None (after it was called), else None."""
        return self.why
