"""A fleet on real network hosts: Linux network namespaces on a bridge, one per host.

:class:`Network` builds, for the test process that enters it, a private /24 on a bridge in the
root namespace (the bridge holds ``.1``: the root namespace is a host too, where the test and
its producer run) and one namespace per named host, each joined to the bridge by a veth pair
(``eth0`` inside, loopback up) at ``.2``, ``.3``, ... A process started with :meth:`Network.run`
runs inside its host's namespace, with a UTS namespace of its own named for the host (so the
workers of two hosts do not share a host name: a lease names its holder by host and PID), and is
stopped by its PID: ``ip netns exec`` and ``unshare`` exec, so the PID of the ``Popen`` is the
process' own.

Faults: :meth:`Network.partition` takes the host's link down at the bridge (a cable pulled: what
either side sends on an open connection waits, no reset; a new connection from the host fails
with "No route to host" once ARP gives up), :meth:`Network.heal` brings it back and the open
connections go on. Delay: this kernel may
have no ``netem``, so :meth:`Network.delay` starts a forwarding proxy (:func:`serve_delay`, run
as ``python -m tests.support.netns delay ...``) on a host, which holds every chunk for half the
delay each way: whoever connects to it is that much further from the target in round trips.

Names carry the test process' PID (``aif-<pid>-<n>-<host>`` namespaces; ``aif<pid hex><n>...``
links, under 15 characters), and the /24 (under 10.213/16) is chosen under a file lock, free of
every address and route in use, so pytest-xdist workers never collide. :meth:`Network.close`
stops every process it started (SIGTERM, then SIGKILL) and deletes every link and namespace it
made, whatever the test did; one left by a test process that no longer runs is deleted by the
next :meth:`Network.start`. Without root or ``ip netns``, :meth:`Network.start` raises
:class:`NetnsUnavailable` with the reason (a fixture turns it into ``pytest.skip``).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from asyncinfer.supervision.processes import die_with_parent, pid_alive

__all__ = ["NetnsUnavailable", "Host", "Network", "serve_delay"]

#: The /16 whose /24s the networks take (one per :class:`Network`).
SUBNETS = "10.213"
#: What every name this module makes starts with.
PREFIX = "aif"
_LOCK = Path(tempfile.gettempdir()) / "asyncinfer-netns.lock"
_serial = 0
_serial_lock = threading.Lock()


class NetnsUnavailable(RuntimeError):
    """This machine or user cannot build the network (not root, no ``ip netns``, ...)."""


@dataclass(frozen=True)
class Host:
    """One host: its name, its namespace, its address, and its link's end at the bridge."""

    name: str
    netns: str
    address: str
    link: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out


def _pid_of_netns(name: str) -> int | None:
    m = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-.+", name)
    return int(m.group(1)) if m else None


def _pid_of_link(name: str) -> int | None:
    m = re.fullmatch(rf"{PREFIX}([0-9a-f]{{6}})[0-9a-f](?:[0-9a-f]|br)", name)
    return int(m.group(1), 16) if m else None


class Network:
    """Hosts on a private /24, each a network namespace; the root namespace is ``.1``.

    Args:
        hosts: the hosts' names (short: ``redis``, ``w1``), in the order of their addresses.
        grace_s: how long :meth:`close` waits for a process after SIGTERM before SIGKILL.
    """

    def __init__(self, hosts: Sequence[str], grace_s: float = 10.0) -> None:
        if not hosts or len(hosts) > 16 or len(set(hosts)) != len(hosts):
            raise ValueError(f"1 to 16 distinct host names, got {list(hosts)}")
        global _serial
        with _serial_lock:
            self.serial, _serial = _serial % 16, _serial + 1
        self.names = list(hosts)
        self.grace_s = grace_s
        tag = f"{os.getpid():06x}"[-6:]
        self.bridge = f"{PREFIX}{tag}{self.serial:x}br"
        self._link_prefix = f"{PREFIX}{tag}{self.serial:x}"
        self._netns_prefix = f"{PREFIX}-{os.getpid()}-{self.serial}"
        self.subnet = ""
        self.hosts: dict[str, Host] = {}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._made_netns: list[str] = []
        self._made_links: list[str] = []

    # -- building and tearing down -----------------------------------------------------------

    @property
    def root_address(self) -> str:
        """The root namespace's address on the bridge (the test process' host)."""
        return f"{self.subnet}.1"

    def address(self, host: str) -> str:
        return self.hosts[host].address

    def start(self) -> Network:
        """Build the bridge, the namespaces and their links; torn down again if a step fails.

        Raises:
            NetnsUnavailable: not root, no ``ip``, or the kernel refuses the bridge or the first
                namespace or link (RuntimeError for a later step).
        """
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (this test process is uid "
                                   f"{os.geteuid()})")
        if shutil.which("ip") is None or shutil.which("unshare") is None:
            raise NetnsUnavailable("no `ip` (iproute2) or `unshare` (util-linux) on PATH")
        remove_stale()
        try:  # the bridge and the first host: where a machine that allows none says so
            with open(_LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the subnet is free until our bridge holds it
                self.subnet = _free_subnet(os.getpid())
                self._make_bridge()
            self._make_host(0, self.names[0])
        except (RuntimeError, OSError) as exc:
            self.close()
            raise NetnsUnavailable(f"cannot build network namespaces here: {exc}") from exc
        try:  # past the first host, a failure is the harness' own: the test fails
            for i, name in enumerate(self.names[1:], start=1):
                self._make_host(i, name)
        except BaseException:
            self.close()
            raise
        return self

    def _make_bridge(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def _make_host(self, i: int, name: str) -> None:
        netns, link = f"{self._netns_prefix}-{name}", f"{self._link_prefix}{i:x}"
        _ip("netns", "add", netns)
        self._made_netns.append(netns)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns)
        self._made_links.append(link)
        address = f"{self.subnet}.{i + 2}"
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("link", "set", link, "master", self.bridge, "up")
        self.hosts[name] = Host(name, netns, address, link)

    def close(self) -> None:
        """Stop every process started here by its PID (SIGTERM together, then SIGKILL after
        ``grace_s``), then delete every link and namespace made here.

        Raises:
            RuntimeError: naming what could not be deleted (after trying everything).
        """
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGCONT)  # a process a test froze cannot exit
                    proc.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self.grace_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        left = []
        for link in reversed(self._made_links):  # a veth's end goes with it; the bridge last
            if _ip("link", "show", link, check=False).returncode == 0:
                out = _ip("link", "del", link, check=False)
                if out.returncode != 0:
                    left.append(f"link {link}: {out.stderr.strip()}")
        for netns in reversed(self._made_netns):
            out = _ip("netns", "del", netns, check=False)
            if out.returncode != 0 and netns in _ip("netns", "list", check=False).stdout:
                left.append(f"netns {netns}: {out.stderr.strip()}")
        self._made_links, self._made_netns, self.hosts = [], [], {}
        if left:
            raise RuntimeError("could not delete: " + "; ".join(left))

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- processes ---------------------------------------------------------------------------

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``: its network namespace, and a UTS namespace named for
        the host. Every step execs, so the process keeps the PID it was started with."""
        netns = self.hosts[host].netns
        return ["ip", "netns", "exec", netns, "unshare", "--uts", "--", "sh", "-c",
                'echo "$0" > /proc/sys/kernel/hostname && exec "$@"', host, *argv]

    def run(self, host: str, argv: Sequence[str], env: dict[str, str] | None = None, *,
            stdout: IO[bytes] | int | None = subprocess.DEVNULL,
            cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``host`` (stderr with stdout); :meth:`close` stops it by its
        PID, and it gets SIGTERM if the test process dies first."""
        proc = subprocess.Popen(self.command(host, argv), env=env, cwd=cwd, stdout=stdout,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent())
        self._procs.append(proc)
        return proc

    def track(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """Have :meth:`close` stop ``proc`` too (one started from :meth:`command` elsewhere)."""
        self._procs.append(proc)
        return proc

    def delay(self, host: str, port: int, target: tuple[str, int], delay_ms: float,
              timeout_s: float = 30.0, log: Path | None = None) -> tuple[str, int]:
        """Start a proxy on ``host``, listening on ``port`` of every address, that forwards to
        ``target`` adding ``delay_ms`` to each round trip (half each way); its address, once it
        accepts connections from this (the root) namespace. Its output goes to ``log``. A proxy
        that dies before it listens (it was seen once under a loaded suite: SIGABRT from the
        chain that enters the namespace, its log empty) is started once more; a second death is
        the error, with the log's end."""
        argv = [sys.executable, "-m", "tests.support.netns", "delay", "--port", str(port),
                "--to", f"{target[0]}:{target[1]}", "--delay-ms", str(delay_ms)]
        root = Path(__file__).resolve().parents[2]
        address = (self.address(host), port)
        for attempt in (1, 2):
            with open(log, "ab") if log is not None else open(os.devnull, "wb") as out:
                proc = self.run(host, argv, {**os.environ, "PYTHONPATH": str(root)}, cwd=root,
                                stdout=out)
            try:
                _wait_listening(address, proc, timeout_s)
                return address
            except RuntimeError:
                if attempt == 2:
                    said = log.read_text(errors="replace")[-2000:] if log is not None else ""
                    raise RuntimeError(f"the proxy on {address} exited with {proc.returncode} "
                                       f"twice; its output: {said!r}") from None
        raise AssertionError("unreachable")

    # -- faults ------------------------------------------------------------------------------

    def partition(self, host: str) -> None:
        """Take ``host``'s link down at the bridge: nothing reaches it or leaves it, and its
        connections see no reset (what they send waits, as on a pulled cable)."""
        _ip("link", "set", self.hosts[host].link, "down")

    def heal(self, host: str) -> None:
        """Bring ``host``'s link back up: its connections go on where they stopped."""
        _ip("link", "set", self.hosts[host].link, "up")


def _free_subnet(pid: int) -> str:
    """A /24 under :data:`SUBNETS` that no address or route on this machine touches, the first
    from one that depends on ``pid``."""
    used = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    for step in range(256):
        third = (pid + step) % 254 + 1
        subnet = f"{SUBNETS}.{third}"
        if f"{subnet}." not in used:
            return subnet
    raise RuntimeError(f"no free /24 under {SUBNETS}.0.0/16")


def remove_stale() -> list[str]:
    """Delete the links and namespaces this module made for test processes that no longer run
    (killed before their teardown); what was deleted."""
    gone = []
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"\d+:\s+([^:@\s]+)", line)
        pid = _pid_of_link(m.group(1)) if m else None
        if m and pid is not None and not pid_alive(pid):
            if _ip("link", "del", m.group(1), check=False).returncode == 0:
                gone.append(m.group(1))
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = _pid_of_netns(name)
        if pid is not None and not pid_alive(pid):
            if _ip("netns", "del", name, check=False).returncode == 0:
                gone.append(name)
    return gone


def _wait_listening(address: tuple[str, int], proc: subprocess.Popen[bytes],
                    timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy on {address} exited with {proc.returncode}")
        try:
            socket.create_connection(address, timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {address} after {timeout_s} s") from None
            time.sleep(0.05)


# -- the delaying proxy (a process on a host) ------------------------------------------------

def serve_delay(port: int, target: tuple[str, int], delay_ms: float) -> None:
    """Listen on ``port`` (every address) and forward each connection to ``target``, every chunk
    held ``delay_ms / 2`` each way from the moment it was read, in order, pipelined (a burst is
    not slowed to a chunk per delay). Runs until killed."""
    server = socket.create_server(("0.0.0.0", port), backlog=128)
    one_way_s = delay_ms / 2000.0
    while True:
        near, _ = server.accept()
        try:
            far = socket.create_connection(target)
        except OSError:
            near.close()
            continue
        for sock in (near, far):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ends = _Ends(near, far)
        for a, b in ((near, far), (far, near)):
            _Pipe(a, b, one_way_s, ends).start()


class _Ends:
    """A connection's two sockets, closed once both directions are done."""

    def __init__(self, *socks: socket.socket) -> None:
        self.socks, self.open, self.lock = socks, 2, threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.open -= 1
            if self.open:
                return
        for sock in self.socks:
            sock.close()


class _Pipe:
    """One direction of a connection: a reader stamps each chunk, a sender sends it when due."""

    def __init__(self, source: socket.socket, sink: socket.socket, delay_s: float,
                 ends: _Ends) -> None:
        self.source, self.sink, self.delay_s, self.ends = source, sink, delay_s, ends
        self.chunks: queue.Queue[tuple[float, bytes]] = queue.Queue(maxsize=1024)

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._send, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                data = self.source.recv(65536)
                self.chunks.put((time.monotonic() + self.delay_s, data))
                if not data:
                    return
        except OSError:
            self.chunks.put((time.monotonic(), b""))

    def _send(self) -> None:
        try:
            while True:
                due, data = self.chunks.get()
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                if not data:
                    self.sink.shutdown(socket.SHUT_WR)
                    return
                self.sink.sendall(data)
        except OSError:
            for sock in (self.source, self.sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        finally:
            self.ends.done()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.netns")
    sub = parser.add_subparsers(dest="command", required=True)
    delay = sub.add_parser("delay", help="a proxy that adds a delay to each round trip")
    delay.add_argument("--port", type=int, required=True)
    delay.add_argument("--to", required=True, help="host:port")
    delay.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args(argv)
    host, _, port = args.to.rpartition(":")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    serve_delay(args.port, (host, int(port)), args.delay_ms)


if __name__ == "__main__":
    main()
