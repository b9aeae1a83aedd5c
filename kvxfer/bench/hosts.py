"""Two "hosts" on one machine (layer: bench tooling; imports only the standard library and kvxfer.errors).

Two Linux network namespaces joined by a veth pair stand in for two machines: traffic between
them crosses a real network device (TCP through the kernel's stack), so UCX cannot take its
shared-memory shortcut (cma) the way it does between two processes of one namespace.

API::

    from kvxfer.bench.hosts import two_hosts, unavailable_reason, HostsUnavailableError

    reason = unavailable_reason()        # None when namespaces can be made here, else why not
    with two_hosts() as (producer, consumer):
        producer.address                 # "10.88.0.1"  (consumer.address == "10.88.0.2")
        producer.netns                   # the namespace's name (unique per call)
        proc = producer.popen([sys.executable, "-m", "x"], env=...)   # a process inside it
        consumer.run(["ping", "-c1", producer.address], check=True)
        producer.command(["python", ...])  # the argv that runs a command inside, for your own Popen
        # in a child process (multiprocessing, spawn): producer.enter() moves the calling
        # thread's process into the namespace; do it before creating any socket or NIXL agent.
    # on exit both namespaces (and so the veth pair) are removed, even after an exception

``two_hosts`` raises ``HostsUnavailableError`` (with the reason) when the caller is not root,
``ip`` is missing or the kernel refuses; tests turn that into ``pytest.skip(str(err))``.

Names carry the creating process's pid and a random token, so parallel runs never collide; the
addresses are the same in every pair but live only inside that pair's namespaces. Namespaces
left by a killed run (their pid is gone) are removed by the next ``two_hosts`` call.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from kvxfer.errors import KvxferError

__all__ = ["Host", "HostsUnavailableError", "PRODUCER_ADDRESS", "CONSUMER_ADDRESS",
           "two_hosts", "unavailable_reason"]

PRODUCER_ADDRESS = "10.88.0.1"
CONSUMER_ADDRESS = "10.88.0.2"
_NAME_PREFIX = "kvxfer-"
_NAME_RE = re.compile(r"^kvxfer-(\d+)-[0-9a-f]+-[pc]$")
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2
_IP_TIMEOUT_S = 10.0


class HostsUnavailableError(KvxferError, RuntimeError):
    """Network namespaces cannot be created here (not root, no ``ip``, or the kernel refused)."""


@dataclass(frozen=True)
class Host:
    """One side of the pair: a namespace and the IPv4 address of its veth end (a /24)."""

    netns: str
    address: str
    device: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside this namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside this namespace; ``kwargs`` go to ``subprocess.Popen``."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: Sequence[str], timeout: float = 60.0, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this namespace to completion (``subprocess.run``, with a deadline)."""
        return subprocess.run(self.command(argv), timeout=timeout, **kwargs)

    def enter(self) -> None:
        """Move the calling process into this namespace, as ``ip netns exec`` does; for a fresh child.

        Joins the network namespace (setns(2)), then gives the process a mount namespace of its
        own with a fresh ``/sys``: UCX lists network interfaces from ``/sys/class/net``, and with
        the old namespace's ``/sys`` it sees only ``lo`` and cannot reach the other host. Sockets
        already open stay in the old namespace and UCX probes interfaces when its context is made,
        so call this first thing in a freshly spawned, single-threaded child.

        Raises:
            HostsUnavailableError: a step failed (the namespace is gone, not root, or threads).
        """
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.netns}", os.O_RDONLY)
        try:
            _check(libc.setns(fd, _CLONE_NEWNET), f"setns into {self.netns!r}")
        finally:
            os.close(fd)
        _check(libc.unshare(_CLONE_NEWNS), "unshare of the mount namespace")
        # Keep the host's mounts from propagating back, then swap /sys for this namespace's.
        _check(libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "making / a slave mount")
        _check(libc.umount2(b"/sys", _MNT_DETACH), "detaching /sys")
        _check(libc.mount(self.netns.encode(), b"/sys", b"sysfs", 0, None), "mounting sysfs on /sys")


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise HostsUnavailableError(f"{what} failed: {os.strerror(err)}")


def _ip(*args: str) -> None:
    """Run one ``ip`` command; a failure raises HostsUnavailableError with ip's own message."""
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostsUnavailableError(f"`ip {' '.join(args)}` did not run: {exc}") from exc
    if done.returncode != 0:
        raise HostsUnavailableError(
            f"`ip {' '.join(args)}` failed (exit {done.returncode}): {done.stderr.strip()}")


def _precondition() -> str | None:
    """Why namespaces surely cannot be made (not root, no ``ip``), or None."""
    if os.geteuid() != 0:
        return "two hosts need network namespaces, which need root (run as root, or with sudo)"
    if shutil.which("ip") is None:
        return "two hosts need the `ip` command (iproute2), which is not installed"
    return None


def _existing() -> list[str]:
    try:
        done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              timeout=_IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale() -> None:
    """Delete namespaces named by a kvxfer run whose process no longer exists."""
    for name in _existing():
        match = _NAME_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_IP_TIMEOUT_S)


def _build(token: str) -> tuple[Host, Host]:
    """Create both namespaces, the veth pair, addresses and routes; return (producer, consumer)."""
    producer = Host(f"{_NAME_PREFIX}{os.getpid()}-{token}-p", PRODUCER_ADDRESS, f"kx{token}p")
    consumer = Host(f"{_NAME_PREFIX}{os.getpid()}-{token}-c", CONSUMER_ADDRESS, f"kx{token}c")
    for host in (producer, consumer):
        _ip("netns", "add", host.netns)
    # Created in the caller's namespace, then each end moved into its own (names are <= 15 chars).
    _ip("link", "add", producer.device, "type", "veth", "peer", "name", consumer.device)
    for host in (producer, consumer):
        _ip("link", "set", host.device, "netns", host.netns)
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.device)
        _ip("-n", host.netns, "link", "set", host.device, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
    return producer, consumer


def _remove(token: str) -> None:
    """Delete both namespaces of ``token`` (the veth pair goes with them); never raises."""
    for role in ("p", "c"):
        name = f"{_NAME_PREFIX}{os.getpid()}-{token}-{role}"
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_IP_TIMEOUT_S)
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # if the move never happened
        subprocess.run(["ip", "link", "del", f"kx{token}p"], capture_output=True, timeout=_IP_TIMEOUT_S)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Create two namespaces joined by a veth pair; yield ``(producer, consumer)``; remove them.

    The producer's end is ``PRODUCER_ADDRESS`` (10.88.0.1), the consumer's ``CONSUMER_ADDRESS``
    (10.88.0.2), both /24 on the pair, with ``lo`` up in each namespace. Processes still running
    inside when the block exits keep their network but the names are removed.

    Raises:
        HostsUnavailableError: not root, no ``ip``, or creating any part failed (what was made
            is removed first).
    """
    reason = _precondition()
    if reason is not None:
        raise HostsUnavailableError(reason)
    _remove_stale()
    token = secrets.token_hex(3)
    try:
        hosts = _build(token)
    except BaseException:
        _remove(token)
        raise
    try:
        yield hosts
    finally:
        _remove(token)


def unavailable_reason() -> str | None:
    """Why ``two_hosts`` cannot work here, or None when it can (it really creates and removes a pair)."""
    try:
        with two_hosts():
            return None
    except HostsUnavailableError as exc:
        return str(exc)
