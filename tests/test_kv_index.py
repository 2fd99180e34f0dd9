"""The router's global KV index (cluster/router/kv_index.py): prefix overlap per worker and tier."""

import pytest

from pdcluster.cluster.router.kv_index import KVIndex


def test_overlap_is_a_prefix_weighted_by_tier():
    index = KVIndex()
    index.stored("p0", "device", [1, 2, 3])
    index.stored("p1", "device", [1])
    index.stored("p1", "disk", [2, 3, 4])
    assert index.overlap("p0", [1, 2, 3, 4]) == 3.0
    assert index.overlap("p1", [1, 2, 3, 4]) == 1.0 + 3 * 0.5
    assert index.overlap("p0", [9, 1, 2]) == 0.0  # a prefix: the first block it lacks ends it
    index.stored("p1", "host", [2])
    assert index.overlap("p1", [1, 2]) == 1.0 + 0.8  # the best tier holding it counts


def test_removed_and_forgotten_blocks_stop_counting():
    index = KVIndex()
    index.stored("d0", "device", [1, 2])
    index.stored("d0", "host", [2])
    index.removed("d0", "device", [2])
    assert index.overlap("d0", [1, 2]) == 1.8 and index.num_blocks("d0") == {"device": 1, "host": 1, "disk": 0, "shared": 0}
    index.removed("d0", "device", [7])  # unknown: ignored
    index.forget_worker("d0")
    assert index.overlap("d0", [1, 2]) == 0.0 and index.num_blocks("d0")["device"] == 0


def test_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="unknown KV tier 'gpu'"):
        KVIndex().stored("p0", "gpu", [1])
