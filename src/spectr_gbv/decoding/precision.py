"""The precision a model runs in, and what about this machine decides it.

A model's dtype `auto` (the default of the real models) is the dtype and linear kernel that ran fastest on this kind of
device: CPU_CLASSES for a CPU, bfloat16 on CUDA (float16 where the device has no bfloat16). An explicit dtype wins,
and so do a given linear_kernel or quantize. The CPU is known by its /proc/cpuinfo flags: machine() names it beside a
run's times, and emulated_bfloat16() tells the engine when a model runs in bfloat16 on a CPU without the units that
make bfloat16 fast. keep_freed_memory() sets the one allocator setting that CPU runs need.
"""
import ctypes
import ctypes.util
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from spectr_gbv.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
BFLOAT16_UNITS = {"AMX-BF16": ("amx_tile", "amx_bf16"), "AVX512-BF16": ("avx512_bf16",)}  # their /proc/cpuinfo flags
X86 = ("x86_64", "amd64", "i386", "i686")  # platform.machine(), lower case


@dataclass(frozen=True)
class CpuClass:
    dtype: str  # what dtype auto picks
    linear_kernel: str | None  # and on which linear layers (linear.py)
    drafter_quantize: str | None  # the drafter quantization that made speculation faster at batch size 1, if one did
    why: str


# What ran fastest on each class of CPU with the Qwen pair, and whether a quantized drafter paid: the measurements are
# in docs/performance.md. A CPU is of the first class it fits (cpu_class).
CPU_CLASSES = {
    "AMX-BF16": CpuClass("bfloat16", None, None,
                         "its AMX units compute bfloat16 matmuls, so a pass over a few positions costs about one"),
    "AVX512-BF16": CpuClass("bfloat16", None, "int8", "its AVX512-BF16 units compute bfloat16 matmuls"),
    "x86 without bfloat16 units": CpuClass(
        "float32", "onednn", "int8_dynamic",
        "bfloat16 would be emulated, and oneDNN computes a decoding step's few rows in float32 faster than torch's "
        "own matmul"),
    "other": CpuClass("float32", None, None, "unmeasured on such a CPU: float32 on torch's own matmul is safe"),
}


@dataclass(frozen=True)
class Precision:
    dtype: str
    linear_kernel: str | None
    reason: str


def cpu_class(arch: str, flags: set[str] | None, onednn: bool) -> str:
    """The class in CPU_CLASSES of a CPU of this architecture (platform.machine()) with these /proc/cpuinfo flags
    (None: unknown), under a torch built with oneDNN or not."""
    for unit, needed in BFLOAT16_UNITS.items():
        if flags is not None and set(needed) <= flags:
            return unit
    if arch.lower() in X86 and flags is not None and onednn:
        return "x86 without bfloat16 units"
    return "other"


def this_cpu() -> str:
    """The class in CPU_CLASSES of this machine's CPU."""
    return cpu_class(platform.machine(), cpu_flags(), torch.backends.mkldnn.is_available())


def auto_precision(device: str, cpu: str, cuda_bfloat16: bool) -> Precision:
    """What dtype auto is on a device of this type ("cpu", "cuda", ...), for a CPU of class `cpu` (CPU_CLASSES) or
    a CUDA device with bfloat16 or not."""
    if device == "cpu":
        choice = CPU_CLASSES[cpu]
        return Precision(choice.dtype, choice.linear_kernel, f"auto, CPU class {cpu}: {choice.why}")
    if device == "cuda":
        if cuda_bfloat16:
            return Precision("bfloat16", None, "auto, CUDA: bfloat16, half the bytes of float32 and its range")
        return Precision("float16", None, "auto, CUDA without bfloat16: float16, half the bytes of float32")
    return Precision("float32", None, f"auto, device {device}: unmeasured, float32 is safe")


def resolve_precision(prefix: str, dtype: str, linear_kernel: str | None, quantize: str | None,
                      device: str) -> Precision:
    """The dtype and linear kernel of a model with these settings (`prefix` names its config key, e.g. "model."): an
    explicit dtype as given; auto, this machine's choice, where a given linear_kernel or quantize replaces the
    choice's linear layers and, for the layers that compute in float32 only, makes the dtype float32."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ConfigError(f"{prefix}dtype", dtype, f"choose auto, {', '.join(DTYPES)}")
    if dtype != "auto":
        return Precision(dtype, linear_kernel, "given")
    kind = device.split(":")[0]
    cuda_bfloat16 = kind == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    choice = auto_precision(kind, this_cpu() if kind == "cpu" else "other", cuda_bfloat16)
    if linear_kernel is None and quantize is None:
        return choice
    given = f"{prefix}linear_kernel={linear_kernel}" if linear_kernel else f"{prefix}quantize={quantize}"
    if linear_kernel == "onednn" or quantize == "int8_dynamic":  # float32 only (linear.check_linear_layers)
        return Precision("float32", linear_kernel, f"auto: float32, the only dtype {given} computes in")
    return Precision(choice.dtype, linear_kernel, f"{choice.reason}; {given} as given")


# --- what this machine is ------------------------------------------------------------------------------------------

def machine(dtype: str) -> str:
    """What the numbers were measured on: the CPU, its bfloat16 units, threads, torch and dtype."""
    units = ", ".join(f"{name}: {value}" for name, value in bfloat16_units().items())
    return (f"{cpu_name()}, {units}, {torch.get_num_threads()} torch threads of {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}, {dtype}")


def bfloat16_units() -> dict[str, str]:
    """yes, no or unknown (no /proc/cpuinfo) for each CPU unit that runs bfloat16 matmuls at speed."""
    flags = cpu_flags()
    return {name: "unknown" if flags is None else ("yes" if set(needed) <= flags else "no")
            for name, needed in BFLOAT16_UNITS.items()}


def emulated_bfloat16(model: torch.nn.Module) -> bool:
    """True for a model with bfloat16 linear weights on a CPU known to lack both units (x86 CPUs before AVX512-BF16):
    there its matmuls are emulated at the same FLOP rate whatever their rows, so a pass over n positions or rows costs
    about n passes over one, and float32 can be faster (dtype auto picks float32 on oneDNN there; docs/performance.md).
    int8 weights (quantize=int8) run on their own kernel, bfloat16 activations or not."""
    weights = model.get_output_embeddings().weight
    return weights.device.type == "cpu" and weights.dtype == torch.bfloat16 and set(bfloat16_units().values()) == {"no"}


def cpu_name() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):  # no lscpu (not Linux)
        lscpu = ""
    names = [line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")]
    return (names[0] if names else "") or platform.processor() or "unknown CPU"


def cpu_flags() -> set[str] | None:
    """The first CPU's flags in /proc/cpuinfo, None where there is none (not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    flags = [line.split(":", 1)[1].split() for line in lines if line.startswith("flags")]
    return set(flags[0]) if flags else None


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt() parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Have glibc serve large blocks from its heap and keep them once freed. By default a block above 32 MB (a
    [B, K, L + 1, V] tensor of probabilities at the Qwen vocabulary is 100 MB) is a fresh mmap whose pages the kernel
    faults in on first touch and unmaps on free, so every call that makes full-vocabulary temporaries pays for page
    faults again, often more than for its arithmetic (docs/performance.md has the verifier arena's scoring with and
    without). The heap then stays at its peak size. False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
