"""What machine a measurement ran on (every recorded figure names it)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's count, at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def describe() -> str:
    """One line: cores, CPU model, and the CUDA device if there is one."""
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken CUDA setup still gets a description
        gpu = None
    return f"{os.cpu_count()}-core {cpu_model()}, " + (f"GPU {gpu}" if gpu else "no GPU")
