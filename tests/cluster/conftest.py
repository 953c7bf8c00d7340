"""The 3-node Ray cluster on this machine (helpers in tests/rl/local_cluster.py)."""

from __future__ import annotations

import pytest
from local_cluster import start_cluster, stop_cluster


@pytest.fixture(scope="module")
def three_node_cluster():
    """Head (rk_head) + 2 workers (rk_w1, rk_w2) on this machine, with the dashboard (job submission)."""
    cluster = start_cluster()
    print(f"\n[cluster] 3 nodes up in {cluster.start_s:.1f} s at {cluster.gcs_address}")
    yield cluster
    stop_cluster(cluster)
