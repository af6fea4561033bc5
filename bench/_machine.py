"""One line saying what machine a benchmark ran on."""

from __future__ import annotations

import os
import platform

__all__ = ["machine_line"]


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


if __name__ == "__main__":
    print(machine_line())
