"""Where the ops run: the CUDA extension built from kernels/, and the backend choice.

`build()` compiles every kernel family folder (kernels/*/*.cpp and *.cu; JIT with ninja, cached per
torch version and target) and registers torch.ops.minfer with each op's fake implementation. It is
a step of its own: `python -m minfer.ops --build`, `build_for(device)` when a model is set up on a
device, the tests' conftest. No op builds anything.

The backend decides the path of an op on GPU tensors: "minfer" runs the CUDA kernels, "torch" the
pure-PyTorch references. It is a context, `with ops.backend("torch"): ...`, by default
$MINFER_BACKEND or "minfer"; leaving the block restores the choice outside it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import os
import re
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

import torch

from ..errors import DeviceError, KernelBuildError, MinferError

KERNEL_DIR = Path(__file__).resolve().parent.parent.parent / "kernels"
EXTENSION_NAME = "minfer_kernels"
BACKENDS = ("minfer", "torch")

_backend: ContextVar[str] = ContextVar("minfer_backend", default=os.environ.get("MINFER_BACKEND", "minfer"))
_loaded: dict[str, Path] = {}  # "build_folder" once the extension is registered
_fake_impls: dict[str, object] = {}


def fake_impl(qualname: str):
    """Collect a fake (meta) implementation; it is registered once the library defines the op."""

    def register(fn):
        _fake_impls[qualname] = fn
        return fn

    return register


# ----------------------------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Inside the block, ops on GPU tensors take `name`'s path: "minfer" (our CUDA kernels) or
    "torch" (the pure-PyTorch references)."""
    if name not in BACKENDS:
        raise MinferError(f"unknown backend {name!r} (from --backend or $MINFER_BACKEND); choose one of {BACKENDS}")
    token = _backend.set(name)
    try:
        yield
    finally:
        _backend.reset(token)


def current_backend() -> str:
    return _backend.get()


def _kernels_selected() -> bool:
    if _backend.get() != "minfer":
        return False
    if "build_folder" not in _loaded:
        raise KernelBuildError("minfer's kernels are not loaded: call minfer.ops.build() first (the engine does "
                               "when a model is set up on a GPU; `python -m minfer.ops --build` compiles them ahead)")
    return True


@functools.cache
def is_sm90(device_index: int) -> bool:
    """Whether GPU `device_index` is an sm_90 part (the wgmma kernels' target); cached, since prefill asks per
    projection."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def use_kernels(t: torch.Tensor) -> bool:
    """True when `t` is on a GPU and the minfer backend is active (the extension must be built)."""
    return t.is_cuda and _kernels_selected()


def kernels_run_on(device: torch.device | str) -> bool:
    """Whether ops on tensors of `device` run minfer's kernels (a GPU under the minfer backend)."""
    return torch.device(device).type == "cuda" and _kernels_selected()


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise DeviceError(f"{what} needs a CUDA GPU and none is visible; run it on a GPU machine.")


# ----------------------------------------------------------------------------------------------
# The build
# ----------------------------------------------------------------------------------------------


def build_dir() -> Path:
    """Where the extension is built: $MINFER_BUILD_DIR, else the user's cache dir, per torch version."""
    root = os.environ.get("MINFER_BUILD_DIR")
    if root is None:
        cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
        root = os.path.join(cache, "minfer", "build")
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", f"torch-{torch.__version__}-sm{target_arch_list()}")
    return Path(root) / tag


def target_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST if set, else the GPU present (Hopper gets 9.0a for wgmma), else 9.0a."""
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if requested:
        return requested
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}" + ("a" if major == 9 else "")
    return "9.0a"


def kernel_sources() -> list[Path]:
    """Every family folder's bindings (*.cpp) and kernels (*.cu). The build names each object file
    after its source's file name alone, so two sources may not share one."""
    sources = sorted(KERNEL_DIR.glob("*/*.cpp")) + sorted(KERNEL_DIR.glob("*/*.cu"))
    seen: dict[str, Path] = {}
    for source in sources:
        clash = seen.setdefault(source.name, source)
        if clash is not source:
            raise KernelBuildError(f"{clash.relative_to(KERNEL_DIR)} and {source.relative_to(KERNEL_DIR)} share a "
                                   "file name, which the build's object files cannot tell apart; rename one")
    return sources


def _ensure_cuda_home() -> None:
    """torch guesses CUDA_HOME from nvcc's folder, which misses the headers when nvcc is a bare
    copy in /usr/local/bin; point it at the toolkit that holds them."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for candidate in ("/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)):
        if os.path.exists(os.path.join(candidate, "include", "cuda_runtime_api.h")):
            os.environ["CUDA_HOME"] = candidate
            return


def build(verbose: bool = False) -> Path:
    """Compile (or reuse) the extension and register torch.ops.minfer; returns the build folder."""
    if "build_folder" in _loaded:
        return _loaded["build_folder"]
    _ensure_cuda_home()
    from torch.utils import cpp_extension

    arch = target_arch_list()
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    log = out / "build.log"
    # torch 2.11 no longer passes its std::string ABI; a host compiler that defaults to the old one
    # builds a binding whose formatted TORCH_CHECK messages crash the process when they cross into libc10.
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    sources = kernel_sources()
    try:
        cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(p) for p in sources],
            extra_include_paths=[str(KERNEL_DIR)],
            extra_cflags=["-O3", "-std=c++17", abi],
            extra_cuda_cflags=["-O3", "-std=c++17", abi, "-lineinfo", "--expt-relaxed-constexpr"],
            build_directory=str(out),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as exc:  # the compiler's output is in the exception text
        log.write_text(str(exc))
        raise KernelBuildError(
            f"building the minfer kernels for {arch} failed; the compiler output is in {log}. "
            "Rerun `python -m minfer.ops --build --verbose` to see every command."
        ) from exc
    log.unlink(missing_ok=True)
    for qualname, fn in _fake_impls.items():
        torch.library.register_fake(qualname, fn)
    _loaded["build_folder"] = out
    return out


def build_for(device: torch.device | str) -> None:
    """Build (or load from the cache) the extension when ops on `device` will run minfer's kernels
    under the current backend: the engine calls it when a model is set up on a device."""
    if torch.device(device).type == "cuda" and _backend.get() == "minfer":
        build()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minfer.ops", description="Build minfer's CUDA kernels (JIT, ninja, cached)."
    )
    parser.add_argument("--build", action="store_true", help="compile every kernel and report where")
    parser.add_argument("--verbose", action="store_true", help="print each compiler command")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 0
    try:
        out = build(verbose=args.verbose)
    except KernelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"minfer kernels built for {target_arch_list()} in {out}")
    return 0
