"""A deployment across hosts, in network namespaces: the SuperLink in one, each SuperNode in its
own, joined by veth pairs on a bridge in the SuperLink's namespace (10.213.0.1/24 for the
SuperLink, 10.213.0.2-4 for the nodes). TLS uses a certificate for 10.213.0.1 only, SuperNode
authentication is on and each partition-id is bound to its node's key. The SuperLink listens on
10.213.0.1, which exists in no other namespace, so every message crosses the veths (whose byte
counters the test reads) and none can reach the host's own network: the host cannot even connect
to it. The 1-round pFLAlign run must equal, bit for bit, the sequential engine's run of the same
run config. The test creates its namespaces and removes them, with every process in them, even
when it fails; without root, or where namespaces cannot be made, it skips and says why. About a
minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, needs_fashion_mnist
from test_deployment import _compare, _environment, _reference_run, _wait_until

pytestmark = [needs_fashion_mnist, pytest.mark.deployment, pytest.mark.slow]

LINK_ADDRESS = "10.213.0.1"
PORT = 39400
NODES = 3
#: one round (every message starts a flwr-clientapp process on its node: a few seconds each)
CONFIG = ["--set", "num-clients=3", "--set", "max-samples=3000", "--set", "methods=pflalign",
          "--set", "rounds=1", "--set", "fraction-train=1.0"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _namespaces_or_skip(prefix: str) -> None:
    """Skip, saying why, where this process cannot create network namespaces and veths."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add); run the suite as root")
    probe = f"{prefix}probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", f"{prefix}t0", "type", "veth", "peer", "name",
            f"{prefix}t1")
    except (OSError, subprocess.CalledProcessError) as err:
        reason = getattr(err, "stderr", "") or str(err)
        pytest.skip(f"cannot create a network namespace with a veth pair here: {reason.strip()}")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)


def _in(namespace: str, *command: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *command]


def _running(pid: str) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stop_namespace(namespace: str) -> None:
    """Kill every process in ``namespace`` (``ip netns pids``), then remove it."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                          timeout=30).stdout.split()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(map(_running, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not any(map(_running, pids)):
            break
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def _certificates(certs: Path) -> None:
    certs.mkdir(parents=True)
    run = lambda *a: subprocess.run(a, check=True, capture_output=True, timeout=60)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
        "/CN=pflalign netns CA", "-keyout", str(certs / "ca.key"), "-out", str(certs / "ca.crt"))
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={LINK_ADDRESS}",
        "-keyout", str(certs / "server.key"), "-out", str(certs / "server.csr"))
    (certs / "server.ext").write_text(
        f"subjectAltName=IP:{LINK_ADDRESS}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    run("openssl", "x509", "-req", "-days", "2", "-in", str(certs / "server.csr"), "-CA",
        str(certs / "ca.crt"), "-CAkey", str(certs / "ca.key"), "-CAcreateserial", "-extfile",
        str(certs / "server.ext"), "-out", str(certs / "server.pem"))


def _counter(namespace: str, interface: str, name: str) -> int:
    return int(subprocess.run(_in(namespace, "cat", f"/sys/class/net/{interface}/statistics/"
                                                    f"{name}"),
                              capture_output=True, text=True, check=True, timeout=30).stdout)


def test_a_deployment_across_network_namespaces_equals_the_simulation(tmp_path):
    prefix = f"pf{os.getpid() % 100000}"
    _namespaces_or_skip(prefix)
    link, nodes = f"{prefix}L", [f"{prefix}N{i}" for i in range(NODES)]
    work, env = tmp_path / "netns", _environment()
    logs = work / "logs"
    logs.mkdir(parents=True)
    created: list[str] = []
    procs: list[subprocess.Popen] = []

    def start(namespace: str, name: str, home: Path, *command: str) -> None:
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen(_in(namespace, *command), stdout=log,
                                      stderr=subprocess.STDOUT, cwd=work, start_new_session=True,
                                      env={**env, "FLWR_HOME": str(home)}))
        log.close()

    try:
        # --- the network: a bridge in the SuperLink's namespace, one veth pair per node ---
        for namespace in [link, *nodes]:
            _ip("netns", "add", namespace)
            created.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", link, "link", "add", "br0", "type", "bridge")
        _ip("-n", link, "addr", "add", f"{LINK_ADDRESS}/24", "dev", "br0")
        _ip("-n", link, "link", "set", "br0", "up")
        for i, namespace in enumerate(nodes):
            outer, inner = f"{prefix}b{i}", f"{prefix}n{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "netns", link)
            _ip("link", "set", inner, "netns", namespace)
            _ip("-n", link, "link", "set", outer, "master", "br0")
            _ip("-n", link, "link", "set", outer, "up")
            _ip("-n", namespace, "addr", "add", f"10.213.0.{2 + i}/24", "dev", inner)
            _ip("-n", namespace, "link", "set", inner, "up")

        # --- certificates, partitions, keys bound to partition-ids ---
        _certificates(work / "certs")
        keys = work / "keys"
        keys.mkdir()
        for i in range(NODES):
            subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f",
                            str(keys / f"node-{i}")], check=True, timeout=30)
        run_config = work / "partitions" / "run-config.toml"
        subprocess.run([sys.executable, "-m", "pflalign.run.export_partitions",
                        *CONFIG, "--set", f"out-dir={work / 'out'}", "--set",
                        f"node-keys={work / 'partitions' / 'node-keys.json'}",
                        "--out", str(work / "partitions"), "--bind-keys", str(keys),
                        "--write-config", str(run_config)],
                       check=True, capture_output=True, timeout=300, cwd=ROOT, env=env)

        # --- the SuperLink, on 10.213.0.1 only ---
        start(link, "superlink", work / "superlink-home", "flower-superlink",
              "--ssl-ca-certfile", str(work / "certs" / "ca.crt"),
              "--ssl-certfile", str(work / "certs" / "server.pem"),
              "--ssl-keyfile", str(work / "certs" / "server.key"),
              "--host", LINK_ADDRESS, "--port", str(PORT),
              "--database", str(work / "superlink.db"),
              "--disable-runtime-dependency-installation", "--enable-supernode-auth")
        _wait_until(lambda: subprocess.run(
            _in(link, "bash", "-c", f"exec 3<> /dev/tcp/{LINK_ADDRESS}/{PORT}"),
            capture_output=True, timeout=10).returncode == 0, 60, "the SuperLink to listen")
        with pytest.raises(OSError):  # the host's own network cannot reach it
            socket.create_connection((LINK_ADDRESS, PORT), timeout=3).close()

        cli_home = work / "cli-home"
        cli_home.mkdir()
        (cli_home / "config.toml").write_text(
            '[superlink]\ndefault = "netns"\n\n[superlink.netns]\n'
            f'address = "{LINK_ADDRESS}:{PORT}"\n'
            f'root-certificates = "{work / "certs" / "ca.crt"}"\n')
        for i in range(NODES):
            subprocess.run(_in(link, "flwr", "supernode", "register",
                               str(keys / f"node-{i}.pub"), "netns"),
                           check=True, capture_output=True, timeout=60, cwd=ROOT,
                           env={**env, "FLWR_HOME": str(cli_home)})

        # --- one SuperNode per namespace, each dialling 10.213.0.1 over its veth ---
        for i, namespace in enumerate(nodes):
            node_config = (f"partition-id={i} num-partitions={NODES} "
                           f"data-path='{work / 'partitions' / f'client-{i}.npz'}' "
                           f"state-dir='{work / f'node-{i}'}' auth-key='{keys / f'node-{i}'}'")
            start(namespace, f"node-{i}", work / f"node-{i}-home", "flower-supernode",
                  "--root-certificates", str(work / "certs" / "ca.crt"),
                  "--superlink", f"{LINK_ADDRESS}:{PORT}", "--port", "39410",
                  "--auth-supernode-private-key", str(keys / f"node-{i}"),
                  "--node-config", node_config)
        for i in range(NODES):
            _wait_until(lambda i=i: "SuperNode ID" in (logs / f"node-{i}.log").read_text(
                errors="ignore"), 120, f"SuperNode {i} to connect")
        before = [_counter(link, f"{prefix}b{i}", "rx_bytes") for i in range(NODES)]

        done = subprocess.run(_in(link, "flwr", "run", ".", "netns", "--stream",
                                  "--run-config", str(run_config)),
                              capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env={**env, "FLWR_HOME": str(cli_home)})
        assert (work / "out" / "results.json").exists(), done.stdout[-3000:] + done.stderr[-2000:]
        results = json.loads((work / "out" / "results.json").read_text())
        method = results["methods"]["pflalign"]
        assert [r["round"] for r in method["rounds"]] == [1]
        assert method["rounds"][0]["eval-audited"] == NODES  # the server recomputed them all
        assert sorted(c["id"] for c in method["clients"]) == [0, 1, 2]
        assert not any(r.get("failures") or r.get("rejected") for r in method["rounds"])

        # every node's replies (an upload of the 2.3 MB model at least) crossed its veth
        sent = [_counter(link, f"{prefix}b{i}", "rx_bytes") - before[i] for i in range(NODES)]
        assert all(b > 2_000_000 for b in sent), sent

        reference = _reference_run(run_config, tmp_path / "reference", set())
        differences, compared = _compare(reference, results)
        assert compared > 50 and not differences, differences
    finally:
        for namespace in reversed(created):
            _stop_namespace(namespace)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in [link, *nodes] if n in listed.split()]
