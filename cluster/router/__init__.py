"""The cluster router, split by concern: config (every tunable), placement (views, policy, breakers),
health (pings, restarts), events (the worker event stream), kv_index (which worker holds which
prompt block, in which tier: from the workers' KV events), submit (placing one request), stream
(a request's events and its client stream), recorder (optional record for tests), router (the
composition, recovery, and the Router contract of cluster/api/router_contract.py)."""

from pdcluster.cluster.router.config import RouterConfig
from pdcluster.cluster.router.recorder import Decision, DecisionRecorder
from pdcluster.cluster.router.router import ClusterRouter

__all__ = ["ClusterRouter", "Decision", "DecisionRecorder", "RouterConfig"]
