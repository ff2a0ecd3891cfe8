"""The CPU this process runs on, probed once (`cpu_caps()`), and our C++ kernels
(`csrc/*.cpp`), built once and loaded as torch operators `minivllm::*`.

`CpuCaps` is the one answer to "what does this CPU run": the kind of kernels torch dispatches
to (`ATEN_CPU_CAPABILITY` included, so forcing `avx2` reads as an AVX2-only CPU everywhere),
VNNI, native BF16, AMX, oneDNN's bf16 kernels, and whether our kernels loaded. Every module
that picks a CPU path reads it; none probes the CPU itself.

The kernels use AVX2 and FMA, so they run on every x86 CPU this project runs on (AVX2-only and
AVX-512 alike; qgemv also has an AVX-512 VNNI path, compiled as such function by function and
chosen at run time); each is a torch operator, so eager code and compiled graphs call it the same
way. They are compiled here, with the C++ compiler torch.compile already needs (`$CXX`, else
g++), against the installed torch's headers, into `<minivllm cache>/kernels/` under a name
that changes with the sources, the torch version and the flags; the first use builds them
(~20 s), later ones load the file. They split their work over torch's thread pool
(`at::parallel_for`), which is OpenMP in torch's CPU wheels: `-fopenmp` makes that a
parallel loop (without it, a serial one), and the process's OpenMP runtime is torch's own.
Where they cannot run (another processor, no compiler) `cpu_kernels_available()` is False,
says why in the log once, and their callers keep torch's own ops.

- `qgemv.cpp`: 4- and 8-bit weights times fp32 activations
  (`minivllm.layers.quantization.kernels.qgemv`), and `minivllm::qgemv_vnni()`, whether its
  VNNI path runs here.
- `paged_decode.cpp`: one query per sequence over the paged KV cache
  (`minivllm.layers.attention.paged_decode`).
- `ggml_blocks.cpp` (+ `ggml_blocks_simd.h`, compiled twice: AVX2 and AVX-512 VNNI): GGUF's
  quantized blocks as stored, matmul and dequantization
  (`minivllm.layers.quantization.kernels.ggml_blocks`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from minivllm.cache import cache_dir
from minivllm.startup import phase

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.cpp"))
HEADERS = sorted((Path(__file__).with_name("csrc")).glob("*.h"))  # included by SOURCES
FLAGS = [
    "-O3",
    "-fopenmp",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-ffp-contract=off",
    "-std=c++20",
    "-shared",
    "-fPIC",
    "-w",
]


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled here."""


def _library_path() -> Path:
    """Where the built kernels live: one file per source texts, torch version and flags."""
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(FLAGS).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    return cache_dir() / "kernels" / f"minivllm-cpu-{digest.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    """Compile SOURCES against the installed torch into `target` (atomically): each source in
    a compiler process of its own, all at once, so a first start waits for the slowest source
    rather than for their sum (docs/benchmarks.md, "Start-up"); then one link."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "g++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = [flag for flag in FLAGS if flag != "-shared"]
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        try:
            jobs = [
                subprocess.Popen(
                    [compiler, *compile_flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes]
                    + ["-c", str(source), "-o", str(obj)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for source, obj in zip(SOURCES, objects, strict=True)
            ]
        except OSError as error:
            raise KernelBuildError(f"no C++ compiler {compiler!r}: {error}") from error
        failed = []
        for source, job in zip(SOURCES, jobs, strict=True):
            _, stderr = job.communicate()
            if job.returncode != 0:
                failed.append(f"{source.name}:\n{stderr[-2000:]}")
        if failed:
            raise KernelBuildError(f"{compiler} failed on " + "\n".join(failed))
        link = [
            compiler,
            *FLAGS,
            *(str(obj) for obj in objects),
            "-o",
            str(built),
            *(f"-L{path}" for path in cpp_extension.library_paths()),
            "-lc10",
            "-ltorch_cpu",
        ]
        result = subprocess.run(link, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise KernelBuildError(
                f"{compiler} failed to link the kernels:\n{result.stderr[-2000:]}"
            )
        os.replace(built, target)


@dataclass(frozen=True)
class CpuCaps:
    """What this CPU runs, probed once per process (`cpu_caps()`)."""

    machine: str  # platform.machine(), e.g. "x86_64"
    capability: str  # torch's kernel kind: "AVX512", "AVX2", "DEFAULT"... (env override applied)
    vnni: bool  # AVX-512 VNNI in hardware (fbgemm's int8 kernels use it whatever torch runs)
    avx512_bf16: bool  # the AVX-512 BF16 instructions in hardware
    amx: bool  # AMX tiles in hardware
    onednn_bf16: bool  # oneDNN has bf16 kernels here and torch exposes its prepacked linear
    kernels: bool  # our `minivllm::*` operators built and loaded
    qgemv_vnni: bool  # qgemv's AVX-512 VNNI path runs (csrc/cpu_features.h decides)

    @property
    def kind(self) -> str:
        """The kernel kind the row thresholds are measured for: "AVX512" or "AVX2"."""
        return "AVX512" if self.capability.startswith("AVX512") else "AVX2"

    @property
    def rows_kind(self) -> str:
        """The row table this CPU reads (`minivllm.layers.quantization.rows`): its kind, or
        "AVX512_AMX" where oneDNN's bf16 matmuls run on AMX tiles, so fast that a weight
        dequantized to bf16 a tile at a time beats the integer kernels at prefill sizes, or
        "AVX512_BF16" where they run on AVX-512 BF16 (fast enough to beat the two-code ones)."""
        if self.native_bf16 and self.onednn_bf16:
            return "AVX512_AMX" if self.amx else "AVX512_BF16"
        return self.kind

    @property
    def native_bf16(self) -> bool:
        """torch runs AVX-512 kernels on a CPU with the BF16 instructions: bf16 is the fast
        dtype (forcing `ATEN_CPU_CAPABILITY=avx2` answers no, as on an AVX2-only CPU)."""
        return self.kind == "AVX512" and self.avx512_bf16


def _onednn_bf16() -> bool:
    """oneDNN's bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; none on an AVX2-only CPU
    such as AMD Zen 3) and torch's prepacked linear ops."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


@functools.cache
def cpu_caps() -> CpuCaps:
    """This CPU's capabilities, probed (and our kernels built or loaded) once; logged once."""
    machine = platform.machine()
    capability = torch.backends.cpu.get_cpu_capability()
    kernels = _load_kernels(machine, capability)
    caps = CpuCaps(
        machine=machine,
        capability=capability,
        vnni=bool(getattr(torch.cpu, "_is_vnni_supported", lambda: False)()),
        avx512_bf16=bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()),
        amx=bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
        onednn_bf16=_onednn_bf16(),
        kernels=kernels,
        qgemv_vnni=kernels and bool(torch.ops.minivllm.qgemv_vnni()),
    )
    logger.info(
        "CPU: torch %s kernels, VNNI %s, BF16 %s, AMX %s, oneDNN bf16 %s, minivllm kernels %s",
        caps.capability,
        caps.vnni,
        caps.avx512_bf16,
        caps.amx,
        caps.onednn_bf16,
        "loaded" if caps.kernels else "not used",
    )
    return caps


@torch.compiler.assume_constant_result  # compiled graphs take the answer, not the probe
def cpu_kernels_available() -> bool:
    """Whether the `minivllm::*` operators run here (`cpu_caps().kernels`)."""
    return cpu_caps().kernels


def _load_kernels(machine: str, capability: str) -> bool:
    """Build (the first time) and load the kernels; False, and why in the log, where they
    cannot run: they need an x86 CPU with AVX2."""
    if machine.lower() not in ("x86_64", "amd64") or capability not in ("AVX2", "AVX512"):
        logger.info(
            "minivllm CPU kernels: not used (they need an x86 CPU with AVX2; torch "
            "runs %s kernels on %s)",
            capability,
            machine,
        )
        return False
    path = _library_path()
    try:
        if not path.is_file():
            with phase(f"building minivllm's CPU kernels (once per torch version): {path}"):
                _build(path)
        torch.ops.load_library(str(path))
    except (KernelBuildError, OSError, RuntimeError) as error:
        logger.warning("minivllm CPU kernels: not used, torch's own ops instead (%s)", error)
        return False
    _register_fakes()
    logger.info(
        "minivllm CPU kernels loaded: qgemv (4/8-bit weights, fp32 activations), "
        "paged_decode (one query per sequence), ggml_* (GGUF blocks as stored)"
    )
    return True


def _register_fakes() -> None:
    """The operators' output shapes, for torch.compile's tracing."""

    @torch.library.register_fake("minivllm::qgemv")
    def _(x, codes, scales, mins, bits):  # noqa: ANN001, ANN202 - torch's fake-op signature
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("minivllm::ggml_matmul")
    def _(x, blocks, qtype, isa):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape[0], blocks.shape[0], dtype=torch.float32)

    @torch.library.register_fake("minivllm::ggml_matmul_segments")
    def _(x, blocks, qtypes, isa):  # noqa: ANN001, ANN202
        # a qtype of 256 or more: x8 tiles, 8 weight rows each
        # (minivllm.layers.quantization.kernels.ggml_blocks)
        columns = sum(b.shape[0] * (8 if q >= 256 else 1) for b, q in zip(blocks, qtypes))
        return x.new_empty(x.shape[0], columns, dtype=torch.float32)

    @torch.library.register_fake("minivllm::ggml_matmul_kinds")
    def _(x, blocks, qtypes, columns, isa, residual_block=0):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape[0], columns, dtype=torch.float32)

    @torch.library.register_fake("minivllm::ggml_dequantize")
    def _(blocks, qtype, cols, dtype, isa, ids=None):  # noqa: ANN001, ANN202
        rows = blocks.shape[0] * (8 if qtype >= 256 else 1) if ids is None else ids.shape[0]
        return blocks.new_empty(rows, cols, dtype=dtype)

    @torch.library.register_fake("minivllm::ggml_dequant_matmul")
    def _(x, blocks, qtype, tile_rows):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape[0], blocks.shape[0] * (8 if qtype >= 256 else 1))

    @torch.library.register_fake("minivllm::ggml_dequant_matmul_kinds")
    def _(x, blocks, qtypes, columns, tile_rows):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape[0], columns)

    @torch.library.register_fake("minivllm::paged_decode")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, ks=None, vs=None):  # noqa: ANN001, ANN202, E501
        return torch.empty_like(q)
