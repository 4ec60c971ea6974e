"""What is being calibrated: the device, its software stack (provenance), and which bundled
profile holds its datasheet peaks."""
from __future__ import annotations

import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass

from calibrate.errors import CalibrationError

__all__ = ["DeviceInfo", "bundled_match", "cpu_model", "detect", "slug"]

BUNDLED_NAMES = (
    # (pattern on torch.cuda.get_device_name, bundled profile). SXM parts only: the PCIe and NVL
    # variants run at other clocks and power (H100 PCIe: 756 dense bf16 TFLOP/s, not 989), so they
    # match nothing and need --base.
    (r"\bH100\b(?!.*(PCIe|NVL)).*\bHBM3\b|\bH100\b.*\bSXM", "h100-sxm-80gb"),
    (r"\bH800\b(?!.*PCIe)", "h100-sxm-80gb"),
    (r"\bH200\b(?!.*NVL)", "h200-sxm-141gb"),
    (r"\bA100\b.*SXM.*80\s*GB", "a100-sxm-80gb"),
    (r"\bA100\b.*SXM.*40\s*GB", "a100-sxm-40gb"),
    (r"\bB200\b", "b200-sxm-180gb"),
)
CAPACITY_TOLERANCE = 0.2
"""A name match is trusted only when the device's memory is within 20% of the profile's (an
H100 94GB or a cut-down part is not the bundled one)."""


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    kind: str
    """cuda | cpu"""
    index: int
    name: str
    memory_bytes: int
    """GPU memory, or the machine's RAM."""
    capability: str = ""
    """compute capability, e.g. 9.0 (GPU only)."""
    driver: str = ""
    cuda: str = ""
    cudnn: str = ""
    nccl: str = ""
    torch: str = ""
    threads: int = 0
    """CPU: torch's intra-op threads."""
    count: int = 0
    """GPU: the GPUs this node shows (torch.cuda.device_count()), which share its NICs; 0 where not
    recorded (a CPU, a report from before it was)."""

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.kind == "cuda":
            return (f"{self.name} (sm {self.capability}, {self.memory_bytes / 2**30:.0f} GiB), "
                    f"driver {self.driver or 'unknown'}, "
                    f"CUDA {self.cuda}, cuDNN {self.cudnn or 'n/a'}, NCCL {self.nccl or 'n/a'}, torch {self.torch}")
        threads = f"{self.threads} thread{'' if self.threads == 1 else 's'}"
        return (f"{self.name} ({threads}, {self.memory_bytes / 2**30:.0f} GiB RAM), "
                f"{platform.system()} {platform.release()}, torch {self.torch}")


def detect(kind: str, index: int = 0) -> DeviceInfo:
    """The device `kind` names; CalibrationError where there is none."""
    import torch

    if kind == "cpu":
        return DeviceInfo(kind="cpu", index=0, name=cpu_model(), memory_bytes=_ram_bytes(), torch=torch.__version__,
                          threads=torch.get_num_threads())
    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)")
        raise CalibrationError(f"--device cuda: no GPU: {why}; use --device cpu to calibrate the CPU")
    if index >= torch.cuda.device_count():
        raise CalibrationError(f"--device cuda: GPU {index} does not exist ({torch.cuda.device_count()} visible)")
    props = torch.cuda.get_device_properties(index)
    nccl = ""
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - NCCL missing is only provenance
        pass
    return DeviceInfo(kind="cuda", index=index, name=props.name, memory_bytes=int(props.total_memory),
                      capability=f"{props.major}.{props.minor}", driver=_driver_version(), cuda=torch.version.cuda or "",
                      cudnn=str(torch.backends.cudnn.version() or ""), nccl=nccl, torch=torch.__version__,
                      count=torch.cuda.device_count())


def bundled_match(name: str, memory_bytes: int) -> str | None:
    """The bundled profile for a GPU called `name` with `memory_bytes` of memory, or None."""
    from hwmodels.profile import load_profile

    for pattern, profile in BUNDLED_NAMES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            cap = load_profile(profile).hbm_capacity
            if abs(memory_bytes - cap) <= CAPACITY_TOLERANCE * cap:
                return profile
            return None
    return None


def _driver_version() -> str:
    """The NVIDIA driver: /proc/driver/nvidia/version on Linux, else nvidia-smi, else ''."""
    try:
        text = open("/proc/driver/nvidia/version").read()
        m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, platform.processor() elsewhere)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def slug(text: str) -> str:
    """'AMD EPYC 9654 96-Core Processor' -> 'amd-epyc-9654-96-core-processor'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"
