"""Autoscaling across machines: Serve's replicas drive Ray's node autoscaler.

Ray's own fake-node provider (``fake_multinode``, what ``ray.cluster_utils.AutoscalingCluster``
uses; that class is not usable from this wheel, which lacks its base YAML, and it stops every
Ray process on the machine) starts Ray's autoscaler on this machine: a head node without the
``replica_slot`` resource every engine replica asks for, and a node type that has one, added on
demand and removed after a few idle seconds. The app is the autoscaled one of
``tests/cluster/test_autoscaling.py`` with that resource. ``tests/cluster/fake_nodes.py`` runs it
in a process of its own (see there why) and this test checks what it saw:

- the first replica cannot be placed on the head: Ray adds a node for it;
- a load that queues makes the policy ask for a second replica: Ray adds a second node;
- the load gone, the policy lets the replica go and Ray lets its node go; every block is free.

That cluster has its own temporary directory and port and is stopped by killing the processes
that name that directory, so any other Ray on the machine (the other tests', a user's) lives on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.fake_nodes import MARK

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_replicas_bring_nodes_and_scaling_down_lets_them_go() -> None:
    # Without token authentication in that process and its cluster (the cluster listens on
    # loopback only): a token of the cluster's own would have to reach the driver too.
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.cluster.fake_nodes"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith(MARK))
    seen = json.loads(line.removeprefix(MARK))
    # The head has no replica slot: the first replica runs on a node Ray added for it.
    assert seen["first"] == [1, 1], seen
    # A second replica, on a second node Ray added for it; then back to one of each.
    assert [2, 2] in seen["seen"], seen
    assert seen["last"] == [1, 1], seen
