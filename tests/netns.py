"""Hosts made of Linux network namespaces, for multi-host tests on one machine.

Each host is a network namespace with its own address in a private test range,
joined to the others by veth pairs on one bridge in the root namespace (which
holds the bridge's address, like a gateway).  :class:`NetnsCluster` then starts
Ray there exactly as on separate machines: ``ray start --head`` in host 0 and
``ray start --address`` in the others, each with ``--node-ip-address``, its own
``--temp-dir`` and token authentication on.  Drivers run inside host 0 as
subprocesses (a Ray driver must run on a cluster node), with a deadline.

Teardown ends every process inside the namespaces by its own id (``ip netns
pids``), then deletes the namespaces, veths and bridge; it runs even when a
test fails and never touches a Ray process outside the namespaces.

Requires root and ``ip netns``; :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON = sys.executable
RAY = str(pathlib.Path(sys.executable).with_name("ray"))
SUBNET = "10.213.0"
# Ray's default ports (6379 here, and those `ray start` takes unasked: 8265, 10001, 52365, ...) are fine in these hosts:
# each is a network namespace with its own ports, so two clusters (the other test process's, another tag's) or a Ray
# on the machine itself never meet on one.  The subnets differ too (test_multihost 10.213.0, test_ray_up 10.213.1,
# benchmarks/multihost.py 10.213.2): the bridges' addresses and routes live in the machine's own namespace.
RAY_PORT = 6379


def sh(*cmd: str, timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run a command with a deadline, capturing its output."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check, **kw)


@functools.cache
def unavailable() -> str | None:
    """Why network-namespace hosts cannot be built here, or None when they can (probed once a session)."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns add, veth pairs, a bridge)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"rmpprobe{os.getpid() % 100000}"
    try:
        sh("ip", "netns", "add", probe, timeout=10)
    except (subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"`ip netns add` fails here: {detail.strip()}"
    finally:
        sh("ip", "netns", "del", probe, timeout=10, check=False)
    return None


@dataclass
class Host:
    """One namespace host: its name (namespace), address, root-side veth and Ray temp dir."""

    index: int
    ns: str
    ip: str
    veth: str
    temp_dir: pathlib.Path

    def exec(self, *cmd: str) -> list[str]:
        """``cmd`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def pids(self) -> list[int]:
        """Every process in this host's network namespace."""
        out = sh("ip", "netns", "pids", self.ns, check=False, timeout=10).stdout
        return [int(p) for p in out.split()]


@dataclass
class NetnsCluster:
    """``n`` namespace hosts on a bridge, optionally running a Ray cluster (head on host 0)."""

    n: int
    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000}")
    subnet: str = SUBNET
    base: pathlib.Path | None = None
    hosts: list[Host] = field(default_factory=list)
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    log: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"rmpbr{self.tag}"

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{RAY_PORT}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of Ray processes and drivers here: token auth on, one torch thread, and the suite's
        worker priority (``RAY_worker_niceness``, tests/conftest.py)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if (not k.startswith("RAY_") or k == "RAY_worker_niceness") and k != "FI_TCP_IFACE"  # hosts use eth0
        }
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.token,
            OMP_NUM_THREADS="1",
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    # ---- network -------------------------------------------------------------------------
    def create(self) -> "NetnsCluster":
        """Bridge, namespaces, veth pairs and addresses (undone by :meth:`teardown`)."""
        if self.base is None:
            self.base = pathlib.Path(f"/tmp/rn{self.tag}")  # short: Ray's unix sockets live under it
        self.base.mkdir(parents=True, exist_ok=True)
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            self.add_host(i)
        return self

    def add_host(self, i: int) -> Host:
        host = Host(i, f"rmp{self.tag}h{i}", f"{self.subnet}.{10 + i}", f"rmp{self.tag}v{i}", self.base / f"h{i}")
        self._ip("netns", "add", host.ns)
        self._ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        self._ip("link", "set", host.veth, "master", self.bridge)
        self._ip("link", "set", host.veth, "up")
        self._ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        self._ip("-n", host.ns, "link", "set", "eth0", "up")
        self._ip("-n", host.ns, "link", "set", "lo", "up")
        self._ip("-n", host.ns, "route", "add", "default", "via", self.gateway)
        host.temp_dir.mkdir(parents=True, exist_ok=True)
        self.hosts.append(host)
        return host

    def _ip(self, *args: str) -> None:
        sh("ip", *args)

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down: its processes live on but nothing reaches them."""
        self._ip("link", "set", self.hosts[i].veth, "down")

    def restore(self, i: int) -> None:
        self._ip("link", "set", self.hosts[i].veth, "up")

    # ---- Ray -----------------------------------------------------------------------------
    def start_ray(self, num_cpus: int = 1, timeout: float = 120) -> "NetnsCluster":
        """``ray start`` on every host, head first, and wait until all nodes are alive."""
        for host in self.hosts:
            self.start_node(host.index, num_cpus=num_cpus)
        self.wait_nodes(self.n, timeout=timeout)
        return self

    def start_node(self, i: int, num_cpus: int = 1) -> None:
        host = self.hosts[i]
        common = [
            f"--node-ip-address={host.ip}",
            f"--temp-dir={host.temp_dir}",
            f"--num-cpus={num_cpus}",
            "--object-store-memory=200000000",
            "--disable-usage-stats",
        ]
        if i == 0:
            cmd = [RAY, "start", "--head", f"--port={RAY_PORT}", "--include-dashboard=false", *common]
        else:
            cmd = [RAY, "start", f"--address={self.address}", *common]
        t0 = time.monotonic()
        result = sh(*host.exec(*cmd), env=self.env(), timeout=120, check=False)
        self.log.append(f"ray start on {host.ns}: rc={result.returncode} in {time.monotonic() - t0:.1f}s")
        if result.returncode != 0:
            raise RuntimeError(f"ray start on {host.ns} failed:\n{result.stdout}\n{result.stderr}")

    def alive_nodes(self) -> list[str]:
        """Addresses of the nodes the head reports alive (asked from inside host 0)."""
        code = (
            "import json, ray; ray.init(address=%r, logging_level='ERROR');"
            "print('NODES', json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))" % self.address
        )
        result = self.python("-c", code, timeout=60, check=False)
        if result.returncode != 0:
            return []
        lines = [line for line in result.stdout.splitlines() if line.startswith("NODES ")]
        return json.loads(lines[-1][6:]) if lines else []

    def wait_nodes(self, count: int, timeout: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            alive = self.alive_nodes()
            if len(alive) >= count:
                return alive
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {alive} of {count} Ray nodes alive after {timeout:g} s")
            time.sleep(1)

    def repair(self, i: int, timeout: float = 120) -> None:
        """Bring a failed host back: end what is left of it, link up, a fresh Ray node, all nodes alive."""
        self.stop_processes(i)
        self.restore(i)
        self.start_node(i)
        deadline = time.monotonic() + timeout
        while True:  # the old node must be declared dead too, or a placement could still pick it
            alive = self.alive_nodes()
            if sorted(alive) == sorted(h.ip for h in self.hosts):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"after repairing {self.hosts[i].ns}: alive nodes {alive}")
            time.sleep(1)

    def python(
        self, *args: str, timeout: float, check: bool = True, host: int = 0, **env: str
    ) -> subprocess.CompletedProcess:
        """``python args`` inside a host (a driver), from the repository root, with a deadline."""
        result = sh(*self.hosts[host].exec(PYTHON, *args), env=self.env(**env), timeout=timeout, check=False, cwd=ROOT)
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{args} failed in {self.hosts[host].ns} (rc {result.returncode}):\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
            )
        return result

    def kill_host(self, i: int, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process of host ``i`` (a lost node when SIGKILL)."""
        pids = self.hosts[i].pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def stop_processes(self, i: int, grace_s: float = 5.0) -> None:
        """End every process of host ``i``: SIGTERM, then SIGKILL what is left after ``grace_s``."""
        host = self.hosts[i]
        for pid in host.pids():  # resume stopped ones so they can act on SIGTERM
            for sig in (signal.SIGCONT, signal.SIGTERM):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while host.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        for _ in range(20):
            left = host.pids()
            if not left:
                return
            self.kill_host(i, signal.SIGKILL)
            time.sleep(0.2)

    # ---- teardown ------------------------------------------------------------------------
    def teardown(self) -> None:
        """End every process in the namespaces, delete namespaces, veths and bridge (idempotent)."""
        self.signal_all(signal.SIGCONT, signal.SIGTERM)  # SIGCONT: a stopped process must see SIGTERM
        deadline = time.monotonic() + 5
        while any(h.pids() for h in self.hosts) and time.monotonic() < deadline:
            time.sleep(0.2)
        for _ in range(20):
            if not any(h.pids() for h in self.hosts):
                break
            self.signal_all(signal.SIGKILL)
            time.sleep(0.2)
        for host in self.hosts:
            sh("ip", "link", "del", host.veth, check=False)
            sh("ip", "netns", "del", host.ns, check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
        self.hosts = []

    def signal_all(self, *sigs: int) -> None:
        for host in self.hosts:
            for pid in host.pids():
                for sig in sigs:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass

    def leftovers(self) -> list[str]:
        """Namespaces, links or processes of this cluster still present (empty after teardown)."""
        found = [ns for ns in sh("ip", "netns", "list", check=False).stdout.split() if ns.startswith(f"rmp{self.tag}h")]
        links = sh("ip", "-o", "link", "show", check=False).stdout
        found += [
            name
            for name in (self.bridge, *(f"rmp{self.tag}v{i}" for i in range(self.n)))
            if f" {name}:" in links or f" {name}@" in links
        ]
        return found


# ---- hosts reachable over SSH, for `ray up` ---------------------------------------------------
SSH_USER = "raympici"


@dataclass
class SshHosts(NetnsCluster):
    """Namespace hosts that behave like separate machines for the cluster launcher.

    Each host runs ``sshd`` as process 1 of its own PID namespace and mount namespace, with its
    own ``/tmp`` (Ray's session files, ``ray_current_cluster``): so ``ray stop``, which the
    launcher runs on every host, sees and ends only that host's processes, and ending ``sshd``
    ends everything on the host.  Homes are shared like an NFS home: user :data:`SSH_USER`,
    home ``/home/raympici``.  NAT through the root namespace gives the hosts the same
    package index as this machine (the user gets this machine's pip settings).
    """

    user: str = SSH_USER
    sshd: list = field(default_factory=list)
    nat_rule: list | None = None
    forward_before: str | None = None

    @property
    def home(self) -> pathlib.Path:
        return pathlib.Path(f"/home/{self.user}")

    @property
    def key(self) -> pathlib.Path:
        return self.base / "laptop" / ".ssh" / "id_ed25519"

    def create(self) -> "SshHosts":
        if self.base is None:  # not under /tmp: each host mounts its own /tmp over it
            self.base = pathlib.Path(f"/var/tmp/rn{self.tag}")
        super().create()
        if shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"):
            raise RuntimeError("sshd is not installed (Debian: apt-get install openssh-server)")
        self._user()
        self._nat()
        for host in self.hosts:
            self.start_sshd(host.index)
        return self

    def _user(self) -> None:
        if sh("id", self.user, check=False).returncode != 0:
            sh("useradd", "--create-home", "--shell", "/bin/bash", self.user)
        sh("usermod", "-p", "*", self.user)  # no password, but not locked: key login allowed
        laptop = self.base / "laptop"  # the machine `ray up` runs on: its own HOME (key, Ray token)
        (laptop / ".ssh").mkdir(parents=True, exist_ok=True)
        (laptop / ".ray").mkdir(parents=True, exist_ok=True)
        (laptop / ".ray" / "auth_token").write_text(self.token)
        if not self.key.exists():
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        ssh_dir = self.home / ".ssh"
        ssh_dir.mkdir(parents=True, exist_ok=True)
        (ssh_dir / "authorized_keys").write_text(self.key.with_suffix(".pub").read_text())
        pip_conf = pathlib.Path.home() / ".config" / "pip" / "pip.conf"
        if pip_conf.exists():  # this machine's package sources (local wheels, PyPI mirror)
            (self.home / ".config" / "pip").mkdir(parents=True, exist_ok=True)
            shutil.copy(pip_conf, self.home / ".config" / "pip" / "pip.conf")
        sh("chown", "-R", f"{self.user}:{self.user}", str(self.home))
        os.chmod(ssh_dir, 0o700)

    def _nat(self) -> None:
        self.forward_before = pathlib.Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
        pathlib.Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        self.nat_rule = ["POSTROUTING", "-s", f"{self.subnet}.0/24", "!", "-o", self.bridge, "-j", "MASQUERADE"]
        if shutil.which("iptables"):
            sh("iptables", "-t", "nat", "-A", *self.nat_rule)
        else:
            self.nat_rule = None

    def start_sshd(self, i: int) -> None:
        host = self.hosts[i]
        tmp = host.temp_dir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o1777)
        conf = host.temp_dir / "sshd_config"
        conf.write_text(
            f"ListenAddress {host.ip}\nPidFile none\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            f"PubkeyAuthentication yes\nUsePAM yes\nAllowUsers {self.user}\nMaxStartups 50\nMaxSessions 50\n"
            "Subsystem sftp /usr/lib/openssh/sftp-server\n"
        )
        pathlib.Path("/run/sshd").mkdir(exist_ok=True)
        script = f"mount --bind {tmp} /tmp && exec /usr/sbin/sshd -D -e -f {conf}"
        log = open(host.temp_dir / "sshd.log", "w")
        proc = subprocess.Popen(
            host.exec(
                "unshare",
                "--pid",
                "--fork",
                "--kill-child",
                "--mount",
                "--propagation",
                "private",
                "--mount-proc",
                "sh",
                "-c",
                script,
            ),
            stdout=log,
            stderr=log,
        )
        self.sshd.append(proc)

    def ssh(self, i: int, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return sh(
            "ssh",
            "-i",
            str(self.key),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=5",
            f"{self.user}@{self.hosts[i].ip}",
            command,
            timeout=timeout,
            check=False,
        )

    def wait_ssh(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        for i in range(self.n):
            while self.ssh(i, "true").returncode != 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sshd on {self.hosts[i].ns} not reachable: {self.ssh(i, 'true').stderr}")
                time.sleep(0.3)

    def teardown(self) -> None:
        super().teardown()  # ends sshd, the process 1 of each host, so every process there with it
        for proc in self.sshd:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.nat_rule:
            sh("iptables", "-t", "nat", "-D", *self.nat_rule, check=False)
            self.nat_rule = None
        if self.forward_before is not None:
            pathlib.Path("/proc/sys/net/ipv4/ip_forward").write_text(self.forward_before)
            self.forward_before = None
