"""Tensor parallelism between two "hosts": two network namespaces on this machine joined by a
veth pair, one MPI rank in each. mpirun runs in the first namespace and starts the second rank's
daemon through an rsh agent that enters the other namespace (in place of ssh); MPI talks over TCP
on the veth subnet only (``btl tcp,self``: no shared memory between the ranks). The split model
must generate the same greedy tokens as one process, and its logits match within 1e-4.

Needs root (``ip netns add``); skipped where namespaces cannot be made."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.models.test_hybrid_common import FIXTURES
from tests.tp.common import MPIRUN, ROOT, mpi_env, needs_mpi

pytestmark = needs_mpi


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    tag = f"pf{os.getpid() % 100000}"
    na, nb = f"{tag}a", f"{tag}b"
    net = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    r = _ip("netns", "add", na, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot create network namespaces here ({r.stderr.strip() or 'ip netns add failed'}; needs root)")
    try:
        try:
            _ip("netns", "add", nb)
            _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
            for ns, dev, host in ((na, f"{tag}va", 1), (nb, f"{tag}vb", 2)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{net}.{host}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot join two network namespaces with a veth pair here: {' '.join(e.cmd)}: "
                        f"{(e.stderr or '').strip()}")
        d = tmp_path_factory.mktemp("hosts")
        agent = d / "agent.sh"  # Open MPI's rsh agent: `agent HOST CMD...` -> CMD inside namespace B
        agent.write_text(f'#!/bin/sh\nshift\nexec ip netns exec {nb} /bin/sh -c "$*"\n')
        agent.chmod(0o755)
        hosts = d / "hosts"
        hosts.write_text(f"{net}.1 slots=1\n{net}.2 slots=1\n")
        yield na, net, agent, hosts
    finally:
        for ns in (na, nb):
            _ip("netns", "del", ns, check=False)


def test_two_namespaces_generate_like_one_process(two_hosts, tmp_path):
    na, net, agent, hosts = two_hosts
    out = tmp_path / "out.json"
    model = FIXTURES / "qwen35kv2.gguf"
    cmd = ["ip", "netns", "exec", na, MPIRUN, "--hostfile", str(hosts), "-np", "2",
           "--mca", "plm_rsh_agent", str(agent), "--mca", "btl", "tcp,self",
           "--mca", "btl_tcp_if_include", f"{net}.0/24", "--mca", "oob_tcp_if_include", f"{net}.0/24",
           "-x", "PYTHONPATH", sys.executable, "-m", "tests.tp.worker", str(out), "--where",
           f"greedy:{model}", f"logits:{model}"]
    r = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and out.exists(), f"mpirun over two namespaces failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    import json

    res = {x["check"]: x for x in json.loads(out.read_text())}
    where = res["where"]
    assert len(set(where["netns"])) == 2, f"both ranks ran in one network namespace: {where}"
    g = res[f"greedy:{model}"]
    assert g["split"] == g["ref"], "greedy tokens over two namespaces differ from one process"
    lg = res[f"logits:{model}"]
    for k in ("prefill", "steps", "verify", "after_rollback", "two_seqs", "restored"):
        assert lg[k] < 1e-4, f"{k}: {lg[k]:.2e}"
