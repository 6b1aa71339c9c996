"""Fixtures of tests/cluster/: hosts made of Linux namespaces (hosts.py), skipped in one line where they
cannot be made (not root)."""
from __future__ import annotations

import pytest

from tests.cluster.hosts import Cluster, sweep, why_not


@pytest.fixture
def hosts(tmp_path):
    """`hosts(n)` makes a cluster of n hosts sharing `tmp_path` (the run's shared file system); every
    cluster made is removed when the test ends, however it ends. Stale namespaces of killed runs go first."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    sweep()
    made: list[Cluster] = []

    def make(n: int) -> Cluster:
        made.append(Cluster(n, tmp_path))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            c.close()
