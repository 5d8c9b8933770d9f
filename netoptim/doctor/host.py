"""``netoptim doctor``'s checks of this host: the software, the CPUs and memory a node or worker gets
here, the node's update path, huge pages, memory files, open files, GPUs."""

from __future__ import annotations

import os
import platform
import resource
from importlib.metadata import PackageNotFoundError, version

import netoptim
from netoptim.cli.job_size_args import JobSize
from netoptim.doctor.findings import Finding
from netoptim.launch.host_cpus import format_cpu_list, numa_nodes, update_threads, usable_cpus
from netoptim.launch.huge_pages import ANONYMOUS_HUGE_PAGES, anonymous_huge_pages
from optimizer_node.state.memory_plan import available_memory
from transport.shm.window import SHMEM_HUGE_ON_ADVICE, SHMEM_HUGE_PAGES, shared_huge_pages

HOST = "this host"
GIB = 2**30
FEW_OPEN_FILES = 1024
"""Below this soft limit a node runs out of descriptors long before its peers' limit (one a connection)."""
DESCRIPTORS_BESIDE_PEERS = 256
"""A node's descriptors besides one per connected worker: ZeroMQ's own, state files being read or
written, memory files and process handles of same-host workers, the admin service's."""


def package_version(name: str) -> str:
    """The installed version of the distribution ``name``, or ``not installed``."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def software() -> Finding:
    import torch
    import zmq

    detail = (
        f"netoptim {netoptim.__version__}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"pyzmq {zmq.pyzmq_version()} (libzmq {zmq.zmq_version()}), grpcio {package_version('grpcio')}, numba {package_version('numba')}"
    )
    return Finding(HOST, "software", "ok", detail, figures={"netoptim": netoptim.__version__, "torch": torch.__version__})


def cpus() -> Finding:
    usable = usable_cpus()
    nodes = numa_nodes(usable=usable)
    threads = update_threads(len(usable))
    where = f"{len(nodes)} NUMA nodes (netoptim node --numa-node N keeps a node's state on one)" if len(nodes) > 1 else "one NUMA node"
    detail = f"{len(usable)} CPUs usable ({format_cpu_list(usable)}), {where}; a node on all of them updates on {threads} threads"
    figures = {"cpus": len(usable), "numa_nodes": len(nodes), "node_update_threads": threads}
    if len(usable) < 2:
        fix = "give the process more CPUs (its affinity, a container's limit): the update, ZeroMQ's I/O and the serve loop take turns on one"
        return Finding(HOST, "cpus", "warn", detail, fix, figures)
    return Finding(HOST, "cpus", "ok", detail, figures=figures)


def memory(plan: JobSize | None) -> Finding:
    available = available_memory()
    if available is None:
        return Finding(HOST, "memory", "note", "this host does not say how much memory is available (/proc/meminfo)")
    detail = f"{available / GIB:.1f} GiB available"
    figures: dict[str, float | int | str | None] = {"available_bytes": available}
    if plan is None:
        return Finding(HOST, "memory", "ok", detail, figures=figures)
    needs = plan.needs()
    out_of_core = needs.ram_out_of_core is not None  # there is one where the job has a memory budget
    wanted = needs.ram_out_of_core if needs.ram_out_of_core is not None else needs.ram_in_memory
    figures |= {"node_needs_bytes": wanted}
    detail += f"; a node's share of the job ({plan.share:,} parameters, {plan.workers} workers) needs {wanted / GIB:.1f} GiB"
    detail += f" out of core within --memory-budget {plan.memory_budget / GIB:.1f}GiB" if plan.memory_budget is not None else " in memory"
    if wanted <= available:
        return Finding(HOST, "memory", "ok", detail, figures=figures)
    fix = "more nodes (--nodes), or out of core: netoptim node --state-dir DIR --memory-budget SIZE (netoptim plan-memory says what each needs)"
    if out_of_core:
        fix = "a smaller --memory-budget, or more nodes: the gradients that arrive in a step are held in memory besides the budget"
    return Finding(HOST, "memory", "fail", detail, fix, figures)


def update_path() -> Finding:
    """Which update a node here runs: the compiled one-pass loop, checked bitwise against torch's
    fused AdamW on this CPU (seconds the first time: numba compiles or loads its cache), or torch ops."""
    from optimizer_node.update.kernels import compiled_update

    if os.environ.get("NETOPTIM_COMPILED_UPDATE", "1") == "0":
        return Finding(HOST, "update path", "note", "torch ops: NETOPTIM_COMPILED_UPDATE=0 turns the compiled loop off (the same bits, slower)")
    if package_version("numba") == "not installed":
        return Finding(
            HOST,
            "update path",
            "warn",
            "torch ops: numba is not installed, so a node here cannot run its compiled one-pass update (the same bits, slower)",
            "pip install 'numba>=0.60' (a dependency of netoptim-train: the install was incomplete)",
        )
    if compiled_update.usable():
        return Finding(HOST, "update path", "ok", "the compiled one-pass update, checked bitwise against torch's fused AdamW on this CPU")
    return Finding(
        HOST,
        "update path",
        "warn",
        "torch ops: the compiled update cannot run here or differs from torch's kernel on this CPU (the same bits, slower; the log above says why)",
        "reinstall numba and llvmlite from wheels that match this numpy; a node logs the same reason at its first update",
    )


UPDATE_PROBE_NUMEL = 16 << 20
"""Parameters of the update-rate probe: 16M, in 4M-element buckets (the default), ~320 MB for a second."""


def update_rate(plan: JobSize | None) -> Finding:
    """The node's update pass here, at the threads a node on all usable CPUs takes, one fp32 gradient
    a bucket, the new values written out as onto a parameter board: Mparam/s, and with ``plan`` the
    least time a step's update of one node's share takes."""
    import torch

    from optimizer_node.update.kernels import compiled_update
    from optimizer_node.update.profile import update_pass_seconds_per_param

    threads = update_threads(len(usable_cpus()))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled = compiled_update.usable()
        seconds = update_pass_seconds_per_param(1, threads, numel=UPDATE_PROBE_NUMEL, repeats=7, compiled=compiled, board=True, bucket_numel=4 << 20)
    finally:
        torch.set_num_threads(previous)
    rate = 1e-6 / seconds
    path = "compiled loop" if compiled else "torch ops"
    detail = f"{rate:,.0f} Mparam/s on {threads} threads ({path}, one gradient a bucket, the new values written out)"
    figures: dict[str, float | int | str | None] = {"mparams_per_s": round(rate, 1), "threads": threads}
    if plan is not None:
        floor_s = plan.share * seconds
        figures["update_seconds_per_step"] = round(floor_s, 3)
        detail += f"; a node here updates its share ({plan.share:,} parameters) in at least {floor_s:.2f} s a step"
    return Finding(HOST, "update rate", "ok", detail, figures=figures)


def huge_pages() -> list[Finding]:
    found = []
    private = anonymous_huge_pages()
    if private in ("madvise", "always"):
        found.append(Finding(HOST, "huge pages", "ok", f"a node's state can live in 2 MiB pages ({ANONYMOUS_HUGE_PAGES}: {private})"))
    else:
        found.append(
            Finding(
                HOST,
                "huge pages",
                "warn",
                f"a node's state lives in 4 KiB pages ({ANONYMOUS_HUGE_PAGES}: {private or 'not there'}): its update pass runs ~7% slower",
                f"as root: echo madvise > {ANONYMOUS_HUGE_PAGES}",
            )
        )
    shared = shared_huge_pages()
    if shared in SHMEM_HUGE_ON_ADVICE:
        found.append(Finding(HOST, "shared huge pages", "ok", f"same-host windows and boards get 2 MiB pages ({SHMEM_HUGE_PAGES}: {shared})"))
    elif shared is not None:
        found.append(
            Finding(
                HOST,
                "shared huge pages",
                "note",
                f"same-host windows and boards get 4 KiB pages ({SHMEM_HUGE_PAGES}: {shared}): workers on a node's host fault in "
                "512 times as many pages on them",
                f"as root: echo advise > {SHMEM_HUGE_PAGES}",
            )
        )
    return found


def memory_files() -> Finding:
    from transport.shm.board import seals_supported

    if seals_supported():
        return Finding(HOST, "memory files", "ok", "sealed memory files work: workers on a node's host read its new values in place (the board)")
    return Finding(
        HOST,
        "memory files",
        "warn",
        "this kernel cannot seal memory files (Linux 5.1+): a node's board is off and same-host workers copy its values through windows",
        "a newer kernel (5.1 or later)",
    )


def open_files(plan: JobSize | None) -> Finding:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft:,}"
    detail = f"a process may open {shown} files (hard limit {'unlimited' if hard == resource.RLIM_INFINITY else f'{hard:,}'})"
    figures: dict[str, float | int | str | None] = {"soft_limit": soft, "hard_limit": hard}
    needed = FEW_OPEN_FILES if plan is None else plan.workers + DESCRIPTORS_BESIDE_PEERS
    if soft != resource.RLIM_INFINITY and soft < needed:
        detail += f": a node serving {plan.workers if plan else 'many'} workers needs about {needed:,} (one a connection)"
        return Finding(HOST, "open files", "warn", detail, f"ulimit -n {max(needed, 65536)} in the node's shell (or LimitNOFILE= in its service unit)", figures)
    return Finding(HOST, "open files", "ok", detail, figures=figures)


GPU_PROBE_BYTES = 256 << 20
"""Bytes of the GPU check's copies each way (a quarter of a second at PCIe 4 speeds)."""


def gpus(plan: JobSize | None, *, measure: bool = True) -> Finding:
    """CUDA devices, page-locked memory, and (``measure``) on the first device its copy rates each
    way; with ``plan``, the least time a step's gradients down and values up take at those rates."""
    import torch

    if not torch.cuda.is_available():
        return Finding(HOST, "gpus", "ok", "no CUDA device: this host can run nodes and CPU workers", figures={"cuda_devices": 0})
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(index) for index in range(count)})
    detail = f"{count} CUDA device(s): {', '.join(names)}"
    try:
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:  # the driver refuses page-locked memory: every copy goes through pageable memory
        return Finding(
            HOST,
            "gpus",
            "warn",
            f"{detail}; page-locked host memory fails ({exc}): copies to and from the device run at pageable speed",
            "raise the memory-lock limit (ulimit -l unlimited) or the container's; check the driver",
            {"cuda_devices": count},
        )
    if not measure:
        return Finding(HOST, "gpus", "ok", f"{detail}; page-locked host memory works", figures={"cuda_devices": count})
    from gpu_worker.layerwise.copy_rates import copy_bandwidth_gbs

    said, figures = copy_rates_said(copy_bandwidth_gbs(torch.device("cuda", 0), GPU_PROBE_BYTES, repeats=3), plan)
    return Finding(HOST, "gpus", "ok", f"{detail}; {said}", figures={"cuda_devices": count, **figures})


def copy_rates_said(rates: dict[str, float], plan: JobSize | None) -> tuple[str, dict[str, float | int | str | None]]:
    """A device's copy rates in words and figures; with ``plan`` the least time a step's gradients
    down and values up take at them (a full-model worker moves the whole model each way a step)."""
    said = f"page-locked copies {rates['pinned_h2d_gbs']:.1f} GB/s to the device, {rates['pinned_d2h_gbs']:.1f} back (pageable to it {rates['pageable_h2d_gbs']:.1f})"
    figures: dict[str, float | int | str | None] = {name: round(value, 2) for name, value in rates.items()}
    if plan is not None:
        moved = plan.params * plan.wire_bytes
        floor_s = max(moved / (rates["pinned_d2h_gbs"] * 1e9), moved / (rates["pinned_h2d_gbs"] * 1e9))
        figures["copy_seconds_per_step"] = round(floor_s, 3)
        said += f"; a step's gradients down and values up take at least {floor_s:.2f} s on device 0"
    return said, figures


def host_findings(plan: JobSize | None, *, measure: bool = True) -> list[Finding]:
    """Every check of this host, in the order they print; ``measure``: the update rate (and a GPU's
    copy rates) as well, a second or two."""
    rate = [update_rate(plan)] if measure else []
    return [software(), cpus(), memory(plan), update_path(), *rate, *huge_pages(), memory_files(), open_files(plan), gpus(plan, measure=measure)]
