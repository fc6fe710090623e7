"""Host RAM this process can still take: `available_host_bytes`.

The kernel's own estimate of what can be allocated without swapping (``MemAvailable`` of ``/proc/meminfo``), capped
by every memory limit of the process's control groups on the way to the root: cgroup v2 ``memory.max`` less
``memory.current`` (plus the page cache it holds that the kernel can drop, ``inactive_file`` of ``memory.stat``), and
cgroup v1 ``memory.limit_in_bytes`` less ``memory.usage_in_bytes`` (likewise ``total_inactive_file``). A container
or a batch job's limit is what the training process may use, not the machine's RAM. None where none of it can be read
(not Linux).

Example:
    >>> room = available_host_bytes()
    >>> room is None or room >= 0
    True
"""

from __future__ import annotations

from pathlib import Path


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None  # ("max": no limit)


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except (OSError, UnicodeDecodeError):
        pass
    return 0


def _mem_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        pass
    return None


def _cgroup_rooms(proc: Path, cgroup_root: Path) -> list[int]:
    """What each memory limit of this process's control groups leaves, from its own group up to the root."""
    rooms: list[int] = []
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return rooms
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: one hierarchy (beside v1's controllers: under "unified")
            bases, limit, usage, cache = ([cgroup_root, cgroup_root / "unified"], "memory.max", "memory.current",
                                          "inactive_file")
        elif "memory" in controllers.split(","):  # cgroup v1: the memory controller's hierarchy
            bases, limit, usage, cache = ([cgroup_root / "memory"], "memory.limit_in_bytes", "memory.usage_in_bytes",
                                          "total_inactive_file")
        else:
            continue
        relative = Path(path.lstrip("/"))
        # (in a container the process's group is mounted as the hierarchy's root: the base itself is among these)
        for folder in [base / p for base in bases for p in (relative, *relative.parents)]:
            cap, used = _number(folder / limit), _number(folder / usage)
            if cap is not None and used is not None and cap < 1 << 60:  # (v1 writes "no limit" as a huge number)
                rooms.append(max(0, cap - used + _stat(folder / "memory.stat", cache)))
    return rooms


def available_host_bytes(proc: str | Path = "/proc", cgroup_root: str | Path = "/sys/fs/cgroup") -> int | None:
    """Host RAM this process can still take (see the module docstring); None when unknown."""
    rooms = _cgroup_rooms(Path(proc), Path(cgroup_root))
    available = _mem_available(Path(proc))
    if available is not None:
        rooms.append(available)
    return min(rooms) if rooms else None


__all__ = ["available_host_bytes"]
