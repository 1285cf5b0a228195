"""Releasing collectives blocked on TCP connections by shutting those connections down.

Measured on torch 2.13 + gloo (see docs/inprocess.md): ``abort()``,
``shutdown()`` or ``destroy_process_group()`` on either side do not wake a rank
blocked in a collective while anything still references the process group; the
blocked call returns at once ("Connection closed by peer") when the TCP
connection under it is shut down, from either end.  So the wrapper snapshots the
sockets open when an iteration starts and, on a fault, ``shutdown(SHUT_RDWR)``s
every TCP connection opened since (gloo pairs, the iteration's TCPStore), except
connections to the wrapper's own store.  ``shutdown`` acts on the socket itself,
so a duplicated fd is enough and the owner's fd stays valid until it closes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

log = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def open_socket_fds() -> frozenset[int]:
    """File descriptors of this process that are sockets."""
    fds: set[int] = set()
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return frozenset()
    for name in names:
        try:
            if os.readlink(f"{_FD_DIR}/{name}").startswith("socket:"):
                fds.add(int(name))
        except (OSError, ValueError):
            continue
    return frozenset(fds)


def open_fd_count() -> int:
    """Number of open file descriptors (for leak checks)."""
    try:
        return len(os.listdir(_FD_DIR))
    except OSError:
        return -1


def _ports(sock: socket.socket) -> tuple[int, int]:
    try:
        local = int(sock.getsockname()[1])
    except (OSError, IndexError, TypeError):
        local = -1
    try:
        remote = int(sock.getpeername()[1])
    except (OSError, IndexError, TypeError):
        remote = -1
    return local, remote


def release_iteration_sockets(
    protected_fds: frozenset[int], protected_ports: frozenset[int]
) -> int:
    """Shut down TCP connections opened since the snapshot; returns how many."""
    released = 0
    for fd in sorted(open_socket_fds() - protected_fds):
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.type != socket.SOCK_STREAM:
                    continue
                # Listening sockets carry no collective; shutting them down
                # can upset gloo's accept loop.
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                local, remote = _ports(sock)
                if local in protected_ports or remote in protected_ports:
                    continue
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    released += 1
            except OSError:
                continue
    log.debug("released %d iteration sockets", released)
    return released
