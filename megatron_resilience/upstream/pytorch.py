"""torch features the runtime uses that not every supported torch (>= 2.4) has, and what gloo lacks."""

from __future__ import annotations

import functools


@functools.cache
def sdpa_has_gqa() -> bool:
    """``scaled_dot_product_attention(..., enable_gqa=True)`` exists (torch >= 2.5)."""
    from megatron_resilience.upstream.versions import package_version

    version = package_version("torch")
    return version is not None and version[:2] >= (2, 5)


def reset_group_names() -> None:
    """With no default process group left, finish what an interrupted ``destroy_process_group()`` left undone, so
    that the next groups are registered and numbered from 0 again, as after a completed one.

    Why: ``destroy_process_group()`` drops the default group first and only then clears c10d's group tables
    (``_world.pg_map``, ``pg_names``, ...), the C++ name registry (``_unregister_all_process_groups``) and the
    process-wide counter that names unnamed groups (``_world.group_count``; all private). An in-process restart
    interrupts the training thread anywhere, its own teardown included; interrupted in between, the next
    ``init_process_group`` either names the default group "38" on one rank and "0" on the others (each waits for
    the other's store keys until the restart's soft timeout; seen with nvidia-resiliency-ext 0.7 on a saturated
    node) or fails outright ("A process group is already registered under the name0", "The specified group name
    has already been created"; seen with 0.4.1 after a soft timeout), and every later in-process iteration fails
    the same way until the budget runs out.
    """
    import torch.distributed

    c10d = torch.distributed.distributed_c10d
    world = getattr(c10d, "_world", None)
    if world is None or torch.distributed.is_initialized():
        return
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                  "pg_coalesce_state"):
        stale = getattr(world, table, None)
        if stale:
            stale.clear()
    unregister_all = getattr(c10d, "_unregister_all_process_groups", None)
    if unregister_all is not None:
        unregister_all()
    if getattr(world, "group_count", 0):
        world.group_count = 0


def abort_gloo_connections(keep_ports: set[int]) -> int:
    """Shut down this process's established TCP connections, except those with a port in ``keep_ports`` (the
    stores'): what frees a rank blocked in a gloo collective, on this rank and on its peers (they see
    "Connection closed by peer" at once). Returns how many were shut down. Linux (reads ``/proc``).

    Why: gloo has no abort that wakes a blocked collective. torch 2.13's ``ProcessGroupGloo.abort()`` and
    ``shutdown()`` and ``destroy_process_group()`` leave it waiting for the group's timeout, since the
    connections stay open while anything references the group (measured: 30 s with a 30 s timeout, 2 s
    with this). NCCL's abort does free it (nvidia-resiliency-ext's ``AbortTorchDistributed``). Listening
    sockets are left alone: shutting gloo's listener down makes its loop thread terminate the process.
    """
    import os
    import socket

    ports_of: dict[str, tuple[int, int]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "01":  # ESTABLISHED
                ports_of[fields[9]] = (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16))
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
        if inode is None or inode not in ports_of or set(ports_of[inode]) & keep_ports:
            continue
        sock = socket.socket(fileno=int(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the fd stays gloo's; only the connection is over
    return count
