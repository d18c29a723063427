"""The lab's network: namespaces, shaped links and routes, created and removed here."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autotuner.lab.spec import LabError, LabSpec, owner_exited

if TYPE_CHECKING:
    pass

# ----------------------------------------------------------------------------- parent side


def _run(*cmd: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise LabError(f"`{cmd[0]}` not found; the lab needs iproute2 (ip, tc)") from e
    if done.returncode != 0:
        hint = " (does this kernel have the tbf qdisc?)" if " tbf " in f" {' '.join(cmd)} " else ""
        raise LabError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}{hint}")
    return done.stdout


def _delete_namespace(ns: str) -> None:
    with contextlib.suppress(LabError):
        for pid in _run("ip", "netns", "pids", ns).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(LabError):
        _run("ip", "netns", "delete", ns)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _reap_leftovers(netns: bool) -> None:
    """Remove what labs of dead (e.g. SIGKILLed) parents left: log dirs, namespaces, /etc/netns."""
    tmp = tempfile.gettempdir()
    for name in filter(owner_exited, os.listdir(tmp)):
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    if not netns:
        return
    names = {line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()}
    with contextlib.suppress(OSError):
        names.update(os.listdir("/etc/netns"))
    for ns in sorted(filter(owner_exited, names)):
        _delete_namespace(ns)


@dataclass
class Net:
    """The namespaces of one lab; ``exec_prefix(i)`` runs a command in process i's namespace."""

    namespaces: list[str]
    addresses: list[str]

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i]] if self.namespaces else []

    def destroy(self) -> None:
        for ns in self.namespaces:
            _delete_namespace(ns)

    @classmethod
    def create(cls, spec: LabSpec, base: str, short: str) -> Net:
        if spec.topology == "none":
            _reap_leftovers(netns=False)
            return cls([], ["127.0.0.1"] * spec.n)
        if os.geteuid() != 0:
            raise LabError(f"topology {spec.topology!r} needs root for network namespaces "
                           f"(running as uid {os.geteuid()}); use lab:none:{spec.n} instead")
        for tool in ("ip", "tc", "sysctl"):
            if shutil.which(tool) is None:
                raise LabError(f"topology {spec.topology!r} needs `{tool}`, which is not on PATH")
        _reap_leftovers(netns=True)
        count = 1 if spec.topology == "shared" else spec.n
        net = cls([f"{base}-{i}" for i in range(count)], [])
        try:
            net._build(spec, short)
        except BaseException:
            net.destroy()
            raise
        return net

    def _build(self, spec: LabSpec, short: str) -> None:
        tbf = ("root", "tbf", "rate", spec.rate, "burst", spec.burst, "latency", spec.latency)
        ring = spec.topology == "ring"
        self.addresses = ([f"10.213.0.{i + 1}" for i in range(spec.n)] if ring
                          else ["127.0.0.1"] * spec.n)
        for i, ns in enumerate(self.namespaces):
            try:
                _run("ip", "netns", "add", ns)
            except LabError as e:
                raise LabError(f"cannot create a network namespace (needs `ip netns`): {e}") from e
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(
                f"127.0.0.1 localhost\n{self.addresses[i]} {socket.gethostname()}\n")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if not ring:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", *tbf)
                continue
            _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/32", "dev", "lo")
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1",
                 "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0")
        n = spec.n if ring else 1
        links = [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)] if n > 2 else []
        peer: dict[tuple[int, int], str] = {}  # (i, j): j's address on the i-j link
        for k, (a, b) in enumerate(links):
            ends = {a: (b, f"10.213.1.{4 * k + 1}"), b: (a, f"10.213.1.{4 * k + 2}")}
            _run("ip", "-n", self.namespaces[a], "link", "add", f"{short}v{b}", "type", "veth",
                 "peer", "name", f"{short}v{a}", "netns", self.namespaces[b])
            for me, (other, addr) in ends.items():
                ns, dev = self.namespaces[me], f"{short}v{other}"
                _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *tbf)
                peer[(other, me)] = addr
        for i in range(n):
            for dst in range(n):
                if dst != i:  # the shorter way round; ties go clockwise
                    hop = (i + 1) % n if (dst - i) % n <= n // 2 else (i - 1) % n
                    _run("ip", "-n", self.namespaces[i], "route", "add", f"{self.addresses[dst]}/32",
                         "via", peer[(i, hop)], "dev", f"{short}v{hop}", "src", self.addresses[i])
