"""The RAM this process may use: the machine's, or less where its control group (a container's or a batch job's
memory limit) caps it, and how much of it is available now."""

from __future__ import annotations

import os
from pathlib import Path

from xlatrain.sizes import readable_bytes

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUPS = Path("/sys/fs/cgroup")


def host_memory(proc_cgroup: Path = PROC_CGROUP, cgroups: Path = CGROUPS) -> tuple[int, str]:
    """The RAM this process may use, and what says so: the machine's, or less where its control group caps it
    (a container's or a batch job's memory limit, which the kernel's out-of-memory killer enforces)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    host = f"the host's {readable_bytes(ram)} of RAM"
    limits = [limit for limit, _ in _control_group_memory(proc_cgroup, cgroups)]
    if limits and min(limits) < ram:
        return min(limits), f"the {readable_bytes(min(limits))} its control group allows (of {host})"
    return ram, host


def _control_group_memory(proc_cgroup: Path, cgroups: Path) -> list[tuple[int, int | None]]:
    """(limit, usage) of each control group that caps this process's memory: cgroup v2's memory.max and
    memory.current or v1's memory.limit_in_bytes and memory.usage_in_bytes, at the root a container sees and
    under the process's own group."""
    v2, v1 = ("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
    places = [(cgroups, v2), (cgroups / "memory", v1)]
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            places.append((cgroups / group.lstrip("/"), v2))
        elif "memory" in controllers.split(","):
            places.append((cgroups / "memory" / group.lstrip("/"), v1))
    found = []
    for directory, (limit_file, usage_file) in places:
        limit = _number_in(directory / limit_file)
        if limit is not None:
            found.append((limit, _number_in(directory / usage_file)))
    return found


def _number_in(path: Path) -> int | None:
    """The number a cgroup file holds; None where it is missing or says there is no limit ("max")."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo"), proc_cgroup: Path = PROC_CGROUP,
                           cgroups: Path = CGROUPS) -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), or less where this process's
    control group leaves less of its limit unused (its usage counts the page cache, so this errs low); None
    where unknown."""
    found = [limit - usage for limit, usage in _control_group_memory(proc_cgroup, cgroups) if usage is not None]
    try:
        found += [int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                  if line.startswith("MemAvailable:")]
    except OSError:
        pass
    return max(min(found), 0) if found else None
