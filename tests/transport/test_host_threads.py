"""OS thread names and CPU time by name (transport/host_threads.py), on this process's own threads."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from transport.host_threads import MAIN_THREAD, cpu_seconds_between, name_os_thread, thread_cpu_seconds, thread_group


def test_a_named_thread_shows_under_its_name_and_its_cpu_counts_in_its_group():
    before = thread_cpu_seconds(os.getpid())
    seen: dict[str, str] = {}
    stop = threading.Event()
    burned = [threading.Event() for _ in range(2)]

    def burn(index: int) -> None:
        name_os_thread()  # its Python name, as a pool's initializer would
        seen[threading.current_thread().name] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        deadline = time.monotonic() + 60
        # Its own CPU, not the process's: other threads of a loaded test process must not end it early.
        while not stop.is_set() and time.monotonic() < deadline:
            sum(range(1000))
            if time.thread_time() > 0.05:
                burned[index].set()

    threads = [threading.Thread(target=burn, args=(index,), name=f"netoptim-burn_{index}") for index in range(2)]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in burned)
    during = thread_cpu_seconds(os.getpid())  # the threads are alive: a group counts only live threads
    stop.set()
    for thread in threads:
        thread.join()
    assert seen == {"netoptim-burn_0": "netoptim-burn_0", "netoptim-burn_1": "netoptim-burn_1"}
    assert MAIN_THREAD in during and "netoptim-burn" in during, during
    spent = cpu_seconds_between(before, during)
    assert spent["netoptim-burn"] > 0 and all(seconds > 0 for seconds in spent.values()), spent
    assert list(spent.values()) == sorted(spent.values(), reverse=True), "largest first"


def test_long_names_are_cut_to_what_the_kernel_keeps_and_pools_group_together():
    seen: list[str] = []

    def named() -> None:
        name_os_thread("a-name-longer-than-fifteen-bytes")
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=named)
    thread.start()
    thread.join()
    assert seen == ["a-name-longer-t"], "the kernel keeps 15 bytes"
    assert [thread_group(n) for n in ("netoptim-write_", "netoptim-read_3", "ZMQbg/IO/0", "admin_12", "update-passes")] == [
        "netoptim-write",
        "netoptim-read",
        "ZMQbg/IO",
        "admin",
        "update-passes",
    ]
