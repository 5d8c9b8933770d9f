"""``netoptim doctor --state-dir DIR``: whether an out-of-core node can keep its state there, and how
fast: writable, what file system, free space for the job, ``O_DIRECT``, the disk's own rates."""

from __future__ import annotations

import errno
import shutil
import tempfile
from pathlib import Path

from netoptim.cli.job_size_args import JobSize
from netoptim.doctor.findings import Finding
from netoptim.doctor.host import GIB
from optimizer_node.state.disk_rate import measure_disk
from optimizer_node.state.memory_plan import STATE_BYTES_PER_PARAM
from optimizer_node.state.ooc_files import probe_direct_io

MOUNTINFO = Path("/proc/self/mountinfo")
IN_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})
NETWORK_FILE_SYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "9p", "fuse.sshfs", "ceph", "glusterfs", "lustre"})


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def file_system(path: Path, mountinfo: Path = MOUNTINFO) -> tuple[str, str] | None:
    """``(mount point, file-system type)`` of the mount that holds ``path`` (resolved), from the kernel's
    mount table; ``None`` where it cannot be read."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best: tuple[str, str] | None = None
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if not sep or len(fields) < 5 or not tail.split():
            continue
        mount_point = _unescape(fields[4])
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= len(best[0])):  # the last of equal ones is the one on top
            best = (mount_point, tail.split()[0])
    return best


def _existing(path: Path) -> Path:
    """``path``, or the nearest directory above it that exists (where the node would create it)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(directory: Path) -> str | None:
    """Why a file cannot be made in ``directory``, or ``None`` where one can."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".netoptim-doctor-"):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def state_dir_findings(state_dir: Path, plan: JobSize | None, probe_bytes: int) -> list[Finding]:
    """Every check of ``state_dir``; ``probe_bytes`` of 0 skips measuring the disk."""
    area = f"state dir {state_dir}"
    if state_dir.exists() and not state_dir.is_dir():
        return [Finding(area, "directory", "fail", "it exists and is not a directory", "give --state-dir a directory (the node creates a missing one)")]
    where = _existing(state_dir)
    if not where.is_dir():
        return [Finding(area, "directory", "fail", f"{where} is not a directory", "give --state-dir a path under a directory")]
    found: list[Finding] = []
    made = "exists" if where == state_dir else f"does not exist yet (the node creates it in {where})"
    problem = _writable(where)
    if problem is not None:
        what = "it" if where == state_dir else str(where)
        fix = f"a directory the node's user can write, or give that user {what}"
        return [Finding(area, "directory", "fail", f"{made}; a file cannot be made in {what}: {problem}", fix)]
    found.append(Finding(area, "directory", "ok", f"{made}, writable"))
    found.append(_file_system_finding(area, where))
    found.append(_space_finding(area, where, plan))
    if probe_direct_io(where):
        found.append(Finding(area, "direct I/O", "ok", "O_DIRECT works: --sync-state-writes reads and writes the state around the page cache"))
    else:
        found.append(Finding(area, "direct I/O", "note", "no O_DIRECT here: --sync-state-writes copies through the page cache, then fdatasyncs and drops it"))
    if probe_bytes:
        found.append(_rate_finding(area, where, plan, probe_bytes))
    return found


def _file_system_finding(area: str, where: Path) -> Finding:
    mount = file_system(where)
    if mount is None:
        return Finding(area, "file system", "note", "unknown: the kernel's mount table cannot be read here")
    mount_point, kind = mount
    detail = f"{kind}, mounted at {mount_point}"
    if kind in IN_MEMORY_FILE_SYSTEMS:
        return Finding(
            area,
            "file system",
            "warn",
            f"{detail}: the state files live in RAM, so out of core saves no memory",
            "a directory on a disk (a local SSD)",
            {"type": kind},
        )
    if kind in NETWORK_FILE_SYSTEMS or kind.startswith("fuse"):
        return Finding(
            area,
            "file system",
            "warn",
            f"{detail}: each step's reads and writes cross a network or a user-space file system",
            "a local disk for the state (checkpoints may go to shared storage: --checkpoint-dir)",
            {"type": kind},
        )
    if kind == "overlay":
        return Finding(area, "file system", "note", f"{detail}: a container's layer; a volume on the host's disk skips the overlay", figures={"type": kind})
    return Finding(area, "file system", "ok", detail, figures={"type": kind})


def _space_finding(area: str, where: Path, plan: JobSize | None) -> Finding:
    free = shutil.disk_usage(where).free
    detail = f"{free / GIB:.1f} GiB free"
    figures: dict[str, float | int | str | None] = {"free_bytes": free}
    if plan is None:
        return Finding(area, "free space", "ok", detail, figures=figures)
    needed = plan.needs().disk_out_of_core
    figures["needed_bytes"] = needed
    detail += f"; a node's share of the job needs {needed / GIB:.1f} GiB (the live state, and a copy per kept checkpoint on the same disk)"
    if needed > free:
        fix = "free space, a larger disk, or more nodes (each holds a share); netoptim plan-memory says what each needs"
        return Finding(area, "free space", "fail", detail, fix, figures)
    return Finding(area, "free space", "ok", detail, figures=figures)


def _rate_finding(area: str, where: Path, plan: JobSize | None, probe_bytes: int) -> Finding:
    probe_dir = Path(tempfile.mkdtemp(prefix=".netoptim-doctor-", dir=where))
    try:
        rates = measure_disk(probe_dir, probe_bytes)
    except OSError as exc:
        full = exc.errno == errno.ENOSPC
        return Finding(
            area,
            "disk rate",
            "fail" if full else "warn",
            f"a {probe_bytes >> 20} MiB probe file could not be written and read: {exc.strerror or exc}",
            "free space on the disk" if full else "check the disk and its permissions (dmesg)",
        )
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    write, read = rates.best_write_gbs, rates.best_read_gbs
    detail = f"sequential write {write:.2f} GB/s, read {read:.2f} GB/s (a {probe_bytes >> 20} MiB probe, the page cache dropped)"
    figures: dict[str, float | int | str | None] = {"write_gbs": round(write, 3), "read_gbs": round(read, 3)}
    if plan is not None:
        state = STATE_BYTES_PER_PARAM * plan.share
        if plan.memory_budget is None or plan.memory_budget < state:
            # the buckets are updated in the same order every step: each is evicted before its next turn,
            # so a step reads and writes all of the state, not only what the budget leaves out
            floor_s = state / (read * 1e9) + state / (write * 1e9)
            figures["disk_seconds_per_step"] = round(floor_s, 3)
            detail += f"; a step reads and writes a node's {state / GIB:.1f} GiB of state: at least {floor_s:.2f} s a step where the page cache cannot hold it"
    return Finding(area, "disk rate", "ok", detail, figures=figures)
