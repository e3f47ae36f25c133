"""What a process forked by a rank keeps of it: none of its listening sockets, and not a life of its own.

A rank forks helpers: megatron-core's temporal async checkpoint writer (``upstream/dist_checkpointing.py``),
torch DataLoader workers, anything a user's code starts with ``multiprocessing`` under the ``fork`` method.
A fork copies every open file descriptor, the listening socket of the process-group store that rank 0 hosts
on the job's port (``runtime/job_store.py``) included. When rank 0 was SIGKILLed while such a helper lived, the
helper kept the port bound, and every in-job restart's new rank 0 failed to bind it: in one chaos run for
14 minutes, because the forked writer blocked for ever on the results pipe whose only reader was the dead
rank (it holds the pipe's read end too, so it never sees a broken pipe). A wait for the port buys nothing
against that; these two rules make it impossible, for every fork the rank makes after :func:`install`:

1. the child closes every listening TCP socket it inherited. A helper serves none of its parent's sockets
   (a writer writes files, a data worker reads them); closing its copy leaves the parent's socket open.
2. the child dies with its parent (``PR_SET_PDEATHSIG``: SIGKILL when the forking thread ends; the forks that
   matter are made by main threads, whose end is the process's), and so a chain of forks dies with the rank. A
   forked writer of a dead rank finishes nothing anyone commits: the rank that would commit it is gone. (One
   was found stuck for ever in a queue lock after its parent, the writer the rank forked, had died.)

Spawned children (``multiprocessing`` ``spawn``/``forkserver``, ``subprocess``) start a new program: Python's
sockets are close-on-exec, and nothing of this module runs there. Installed by the trainer before the store
binds; idempotent; Linux only (elsewhere a no-op).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_session = -1  # the rank's session when install() ran: the rules apply to forks inside it
_rank_pid = 0
_parent_pid = 0
_applies = False


def listening_inet_sockets() -> list[int]:
    """File descriptors of this process that are listening TCP sockets (IPv4 or IPv6)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:  # closed meanwhile, or the directory's own descriptor
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and \
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                found.append(fd)
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays open: this only looked at it
    return found


def _before_fork() -> None:
    """Every fork inside the rank's session, from a main thread: the rank's children and theirs (megatron-core's
    writer forks its own writer processes), each tied to its parent, so the chain ends with the rank. A process
    that left the session is left alone: nvidia-resiliency-ext's in-process monitor daemonizes (fork, setsid,
    fork) on purpose, to outlive the rank and report its death."""
    global _applies, _parent_pid
    _parent_pid = os.getpid()
    _applies = os.getsid(0) == _session and threading.current_thread() is threading.main_thread()


def _in_child() -> None:
    if not _applies:
        return
    for fd in listening_inet_sockets():
        try:
            os.close(fd)
        except OSError:
            pass
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _parent_pid:  # the parent died between the fork and the line above
        os._exit(1)


def install() -> None:
    """Apply both rules to every later ``os.fork`` of this process (and of ``multiprocessing``'s fork method)."""
    global _rank_pid, _session
    if _rank_pid == os.getpid() or not sys.platform.startswith("linux"):
        return
    if _rank_pid == 0:  # hooks are inherited by forks: register once
        os.register_at_fork(before=_before_fork, after_in_child=_in_child)
    _rank_pid, _session = os.getpid(), os.getsid(0)
