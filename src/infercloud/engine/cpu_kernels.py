"""Build and load the engine's own C++ kernels for the CPU (`csrc/`), once per machine.

The kernels are compiled with the system's C++ compiler against the installed torch's headers
and registered as torch operators (`torch.ops.infercloud.*`). The shared object is cached under
`cache_dir()/kernels/<key>/`, where the key hashes the source, the torch version, the compiler
flags and this CPU's instruction-set flags (the build uses `-march=native`, so a cache moved to
another CPU is rebuilt, not run). A build writes to a temporary file and renames it into place,
so two processes building at once cannot load a half-written file.

The operators: `paged_decode_attention` (paged_attention.cpp) and the fused element-wise parts
of a layer, `rms_norm`, `add_rms_norm`, `rotary_embedding_`, `silu_and_mul` (layer_ops.cpp),
the GEMMs `linear_bf16` (linear_bf16.cpp) and `linear_f32` (linear_f32.cpp),
`paged_prefill_attention` (prefill_attention.cpp), `greedy_tokens` (greedy_tokens.cpp: greedy
sampling's argmax), `write_kv_tiled` (kv_layout.cpp: new keys and values into caches in the
tiled layout of kv_layout.h, which both attention kernels read with `tiled=True`), and the
class `torch.classes.infercloud.DecoderStack` that runs a model's layers through them in one
call (decoder_stack.cpp). The vector code is written once on vec_math.h and built at the
width the CPU has: AVX-512 (16 float32 lanes) or AVX2 (8). Where the CPU has AMX, the bfloat16
GEMM (`use_tiles`) and both attention kernels (`tile_unit`) run their products on the tile unit
(amx.h: the tile configuration record and the per-process grant, `has_attention_tiles()`).
Where no compiler is present or the build fails, `load_kernels()` returns False with the reason
in `load_error()`, and the engine keeps these in plain torch (`attention.py`, `llama.py`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from infercloud.models.registry import cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    CSRC / "paged_attention.cpp",
    CSRC / "layer_ops.cpp",
    CSRC / "linear_bf16.cpp",
    CSRC / "linear_f32.cpp",
    CSRC / "prefill_attention.cpp",
    CSRC / "decoder_stack.cpp",
    CSRC / "greedy_tokens.cpp",
    CSRC / "kv_layout.cpp",
)
HEADERS = (
    CSRC / "vec_math.h",
    CSRC / "f32_gemm.h",
    CSRC / "bf16_dot.h",
    CSRC / "kv_layout.h",
    CSRC / "amx.h",
)
CXX_FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c++17",
    "-w",
)
"""`-fopenmp` links libgomp.so.1, which resolves to the copy torch already loaded: one OpenMP
thread pool in the process, not two contending for the cores. `-ffp-contract=off`: no fused
multiply-adds where the source has a product and a sum, so results round as torch's separate
element-wise ops do (the kernels' explicit FMA intrinsics are unaffected)."""

_errors: list[str] = []


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for part in (
        *(f.read_bytes() for f in (*SOURCES, *HEADERS)),
        torch.__version__.encode(),
        " ".join(CXX_FLAGS).encode(),
        compiler.encode(),
        _cpu_flags().encode(),
        sys.version.encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _compile(compiler: str, out: Path) -> None:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    command = [
        compiler,
        *CXX_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        *(str(f) for f in SOURCES),
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-o",
        tmp_name,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr[-2000:]}")
        os.replace(tmp_name, out)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


@functools.cache
def load_kernels() -> bool:
    """Whether the `torch.ops.infercloud.*` operators are available (building them on the first
    call on this machine: about 15 s). Never raises; see `load_error()` on False."""
    if os.environ.get("INFERCLOUD_CPU_KERNELS", "1") == "0":
        _errors.append("disabled by INFERCLOUD_CPU_KERNELS=0")
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        _errors.append("no C++ compiler (g++ or c++) on PATH")
        return False
    target = cache_dir() / "kernels" / _build_key(compiler) / "infercloud_cpu_kernels.so"
    try:
        if not target.is_file():
            log.info("building the CPU kernels into %s", target)
            _compile(compiler, target)
        torch.ops.load_library(str(target))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _errors.append(str(exc))
        log.warning("CPU kernels unavailable, the engine stays in plain torch: %s", exc)
        return False
    return True


def load_error() -> str | None:
    """Why `load_kernels()` returned False, if it did."""
    return _errors[-1] if _errors else None
