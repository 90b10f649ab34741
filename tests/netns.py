"""Real links for tests: edge processes in Linux network namespaces, with real packet loss and rate caps.

A `Lab` (one per test) is a bridge in the root namespace holding the gateway's
address, and per edge a network namespace joined to the bridge by a veth pair::

    root namespace                                  namespace ef-<id>-<i>
    gateway process --- bridge ef<id>b ---- veth ef<id>h<i> ====== ef0   edge process
                        10.213.N.1/24       (tbf rate cap)    (tbf)  10.213.N.<i+2>/24
                                                                      nft table inet elasticfed:
                                                                      input:  drop N% to the edge
                                                                      output: drop N% from the edge

Loss is an nftables table in the edge's namespace (`numgen random mod 100 < N drop`
on the input and output hooks, only for the veth); a rate cap is a `tbf` qdisc on
both ends of the veth.  Both can be changed while processes run (`set_loss`,
`set_rate`).  Packets dropped at the output hook never leave the edge: the
kernel's TCP sees a failed transmit and retries from its timers, which is how a
lossy uplink looks to a sender; packets dropped at the input hook are real path
loss (they crossed the link and vanish before TCP sees them).

Names carry the pid of the process that made them (`<id>` = pid in base 36, 5
characters, then a per-process counter), so parallel runs never clash and a run
killed before its teardown is swept by the next one (`sweep_stale`): whatever
namespace or link of ours belongs to a pid that no longer exists is deleted, with
any process left inside it.  Addresses come from 10.213.0.0/16, one /24 per lab,
chosen under a file lock among the /24s no interface or route already uses.

Creating a lab raises `Unavailable` (the command that failed and its stderr) when
the machine cannot do it: not root, a tool missing, no netns/veth/bridge/nftables/tbf
in the kernel.  The fixtures turn that into a skip with that text.
"""

from __future__ import annotations

import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

TOOLS = ("ip", "nft", "tc")
SUBNETS = ipaddress.ip_network("10.213.0.0/16")
LOCK_PATH = "/run/elasticfed-netns.lock"
ALIAS = "elasticfed test lab"  # set on every link we create: the sweep only touches these
EDGE_IF = "ef0"  # the edge's end of its veth, inside its namespace
TABLE = "elasticfed"

_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_labs = itertools.count()
# ef-<pid:5><lab>-<edge>  /  ef<pid:5><lab>b (bridge)  /  ef<pid:5><lab>h<edge> (host end of a veth)
_NS_NAME = re.compile(r"^ef-([0-9a-z]{5})[0-9a-z]{1,3}-\d{1,3}$")
_LINK_NAME = re.compile(r"^ef([0-9a-z]{5})[0-9a-z]{1,3}(?:b|h\d{1,3})$")


class Unavailable(Exception):
    """This machine cannot build a lab; the text names the failing command and what it said."""


class CommandFailed(Exception):
    pass


def _b36(n: int, width: int = 0) -> str:
    digits = ""
    while True:
        n, r = divmod(n, 36)
        digits = _B36[r] + digits
        if n == 0:
            break
    return digits.rjust(width, "0")


def sh(*argv: str, stdin: str | None = None, timeout: float = 30) -> str:
    """Run a command; its stdout, or CommandFailed naming the command, exit code and stderr."""
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CommandFailed(f"`{' '.join(argv)}` failed: {exc}") from None
    if done.returncode != 0:
        what = f"`{' '.join(argv)}`" + (f" (stdin: {stdin.strip()!r})" if stdin else "")
        raise CommandFailed(f"{what} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _quiet(*argv: str) -> None:
    """Teardown: do it, whatever it says (the object may be gone already)."""
    try:
        subprocess.run(argv, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass


def check_tools() -> None:
    if os.geteuid() != 0:
        raise Unavailable(f"network namespaces need root; this is uid {os.geteuid()}")
    for tool in TOOLS:
        if shutil.which(tool) is None:
            raise Unavailable(f"`{tool}` is not on PATH (apt-get install iproute2 nftables)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still running in namespace `ns` (all started by a lab), and reap ours."""
    try:
        pids = [int(p) for p in sh("ip", "netns", "pids", ns).split()]
    except CommandFailed:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sweep_stale() -> list[str]:
    """Delete namespaces and links of ours whose creating process is gone; what was deleted."""
    removed = []
    try:
        names = sh("ip", "netns", "list").split("\n")
    except CommandFailed:
        names = []
    for line in names:
        ns = line.split(" ")[0]
        m = _NS_NAME.match(ns)
        if m and not _pid_alive(int(m.group(1), 36)):
            _kill_inside(ns)
            _quiet("ip", "netns", "delete", ns)
            removed.append(ns)
    try:
        links = sh("ip", "-o", "link", "show")
    except CommandFailed:
        links = ""
    for line in links.splitlines():
        # "7: ef01abc0h0@if2: <...> ... \    alias elasticfed test lab"
        parts = line.split(":", 2)
        if len(parts) < 3 or ALIAS not in line:
            continue
        link = parts[1].strip().split("@")[0]
        m = _LINK_NAME.match(link)
        if m and not _pid_alive(int(m.group(1), 36)):
            _quiet("ip", "link", "delete", link)
            removed.append(link)
    return removed


def _used_networks() -> list[ipaddress.IPv4Network]:
    used = []
    text = sh("ip", "-4", "-o", "addr", "show") + sh("ip", "-4", "route", "show", "table", "all")
    for token in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)\b", text):
        try:
            used.append(ipaddress.ip_network(token, strict=False))
        except ValueError:
            pass
    return used


def _chance(pct: int) -> str:
    """The nftables match for `pct`% of packets (100: every one; numgen's range stops at 99)."""
    return "" if pct >= 100 else f"numgen random mod 100 < {pct} "


@dataclass
class EdgeNet:
    """One edge's namespace and veth; `argv` runs a command inside it."""

    ns: str
    host_if: str
    address: str
    loss: tuple[int, int] = (0, 0)  # percent dropped: (to the edge, from the edge)
    rate: str | None = None

    def argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def set_loss(self, inbound: int, outbound: int | None = None) -> None:
        """Drop `inbound`% of packets to the edge and `outbound`% (default: the same) from it, now."""
        outbound = inbound if outbound is None else outbound
        for pct in (inbound, outbound):
            if not 0 <= pct <= 100:
                raise ValueError(f"loss is a percentage, got {pct}")
        rules = [f"flush chain inet {TABLE} input", f"flush chain inet {TABLE} output"]
        if inbound:
            rules.append(f'add rule inet {TABLE} input iifname "{EDGE_IF}" {_chance(inbound)}counter drop')
        if outbound:
            rules.append(f'add rule inet {TABLE} output oifname "{EDGE_IF}" {_chance(outbound)}counter drop')
        # One nft transaction: the old rules go and the new ones come at once.
        sh("ip", "netns", "exec", self.ns, "nft", "-f", "-", stdin="\n".join(rules) + "\n")
        self.loss = (inbound, outbound)

    def dropped_packets(self) -> dict[str, int]:
        """Packets the loss rules dropped so far in each direction (counters reset when loss changes)."""
        text = sh("ip", "netns", "exec", self.ns, "nft", "list", "table", "inet", TABLE)
        out = {"inbound": 0, "outbound": 0}
        chain = ""
        for line in text.splitlines():
            m = re.match(r"\s*chain (\w+)", line)
            if m:
                chain = m.group(1)
            c = re.search(r"counter packets (\d+)", line)
            if c:
                out["inbound" if chain == "input" else "outbound"] += int(c.group(1))
        return out

    def set_rate(self, rate: str | None, burst: str = "16kb", latency: str = "300ms") -> None:
        """Cap both directions of the veth at `rate` (tc syntax: '1mbit'); None removes the cap."""
        for netns, dev in ((["-n", self.ns], EDGE_IF), ([], self.host_if)):
            if rate is None:
                if self.rate is not None:
                    sh("tc", *netns, "qdisc", "del", "dev", dev, "root")
            else:
                sh(
                    "tc", *netns, "qdisc", "replace", "dev", dev, "root",
                    "tbf", "rate", rate, "burst", burst, "latency", latency,
                )  # fmt: skip
        self.rate = rate

    def close(self) -> None:
        _kill_inside(self.ns)
        # Deleting a namespace frees its veth asynchronously: delete our end first, explicitly.
        _quiet("ip", "link", "delete", self.host_if)
        _quiet("ip", "netns", "delete", self.ns)


@dataclass
class Lab:
    """A bridge with the gateway's address and the edges' namespaces; `close` removes everything."""

    lab_id: str
    bridge: str
    network: ipaddress.IPv4Network
    edges: list[EdgeNet] = field(default_factory=list)

    @property
    def gateway_address(self) -> str:
        return str(self.network.network_address + 1)

    def free_port(self) -> int:
        """A TCP port free on the gateway's address now (the caller binds it next)."""
        with socket.socket() as s:
            s.bind((self.gateway_address, 0))
            return int(s.getsockname()[1])

    @classmethod
    def create(cls) -> Lab:
        check_tools()
        lab_id = _b36(os.getpid(), 5) + _b36(next(_labs))
        bridge = f"ef{lab_id}b"
        lab: Lab | None = None
        with open(LOCK_PATH, "a") as lock:
            # Choosing a free /24 and taking it is one step for all runs on this machine.
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                used = _used_networks()
                candidates = SUBNETS.subnets(new_prefix=24)
                free = next(n for n in candidates if not any(n.overlaps(u) for u in used))
                lab = cls(lab_id, bridge, free)
                sh("ip", "link", "add", bridge, "type", "bridge")
                sh("ip", "link", "set", "dev", bridge, "alias", ALIAS)
                sh("ip", "addr", "add", f"{lab.gateway_address}/24", "dev", bridge)
                sh("ip", "link", "set", "dev", bridge, "up")
            except (CommandFailed, StopIteration) as exc:
                if lab is not None:
                    lab.close()
                raise Unavailable(str(exc) or "no free /24 in 10.213.0.0/16") from None
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return lab

    def add_edge(self) -> EdgeNet:
        """A namespace joined to the bridge, lo up, an nft loss table (0% for now), no rate cap."""
        i = len(self.edges)
        if i + 2 >= self.network.num_addresses - 1:
            raise ValueError("a lab holds at most 253 edges")
        net = EdgeNet(
            ns=f"ef-{self.lab_id}-{i}",
            host_if=f"ef{self.lab_id}h{i}",
            address=str(self.network.network_address + 2 + i),
        )
        self.edges.append(net)
        table = (
            f"table inet {TABLE} {{\n"
            "  chain input {\n    type filter hook input priority 0; policy accept;\n  }\n"
            "  chain output {\n    type filter hook output priority 0; policy accept;\n  }\n"
            "}\n"
        )
        steps = [
            ("ip", "netns", "add", net.ns),
            # The edge end is born inside the namespace: no name of ours is ever loose in the root one.
            ("ip", "link", "add", net.host_if, "type", "veth", "peer", "name", EDGE_IF, "netns", net.ns),
            ("ip", "link", "set", "dev", net.host_if, "alias", ALIAS),
            ("ip", "link", "set", "dev", net.host_if, "master", self.bridge),
            ("ip", "link", "set", "dev", net.host_if, "up"),
            ("ip", "-n", net.ns, "link", "set", "dev", "lo", "up"),
            ("ip", "-n", net.ns, "addr", "add", f"{net.address}/24", "dev", EDGE_IF),
            ("ip", "-n", net.ns, "link", "set", "dev", EDGE_IF, "up"),
        ]
        try:
            for argv in steps:
                sh(*argv)
            sh("ip", "netns", "exec", net.ns, "nft", "-f", "-", stdin=table)
            net.set_loss(0)
            # Probe that tbf exists here (the kernel may lack sch_tbf), then take it off again.
            net.set_rate("100mbit")
            net.set_rate(None)
        except CommandFailed as exc:
            raise Unavailable(str(exc)) from None
        return net

    def close(self) -> None:
        for net in self.edges:
            net.close()
        _quiet("ip", "link", "delete", self.bridge)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this lab that still exist (empty after `close`)."""
        ns = [n.split(" ")[0] for n in sh("ip", "netns", "list").splitlines()]
        links = re.findall(r"^\d+: ([^:@]+)", sh("ip", "-o", "link", "show"), re.M)
        return [n for n in ns + links if n.startswith((f"ef-{self.lab_id}-", f"ef{self.lab_id}"))]


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def netns_swept() -> list[str]:
    """Once per session, before the first lab: remove what killed earlier runs left behind."""
    try:
        check_tools()
    except Unavailable:
        return []
    return sweep_stale()


@pytest.fixture
def netns_lab(netns_swept: list[str]) -> Iterator[Lab]:
    """A lab for this test, always torn down (test failed, or Ctrl-C), or a skip saying why there is none."""
    try:
        lab = Lab.create()
    except Unavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    try:
        yield lab
    finally:
        lab.close()


def lab_edge(lab: Lab) -> EdgeNet:
    """`lab.add_edge()`, skipping the test (with the failing command) where namespaces cannot be made."""
    try:
        return lab.add_edge()
    except Unavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")
