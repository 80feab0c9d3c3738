"""Node identity: Flower's node ids ↔ dropfl's client indices (partition ids 0..N-1).

dropfl's strategies, availability models and participation logs index clients 0..N-1. Flower's server sees
node ids, which are not those: Flower's simulation registers its supernodes with ids drawn at random
(`flwr/server/superlink/fleet/vce/vce_api.py`, `_register_nodes`: `LinkState.create_node`, a fresh random
id per run) and gives supernode i the node config `partition-id = i`; a deployed SuperNode gets its
partition id from `flower-supernode --node-config "partition-id=3 ..."`. Only the client knows its
partition id, so the server learns the map by asking: `discover` sends one Flower `query` message to every
connected node before the first round, and each ClientApp answers with `partition_reply` (its
`context.node_config["partition-id"]`). The map is then known before any round selects its participants
(learning it from the first training replies would be too late for round 1's selection), it does not rest
on how a Flower version numbers its nodes, and it works the same in simulation and in a deployment.

Client side::

    app = ClientApp()
    app.query()(partition_reply)          # or call partition_reply from your own query handler

Server side (inside a ServerApp's main)::

    nodes = discover(grid, n_clients)     # NodeMap: nodes.partition(node_id), nodes.node(partition_id)
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

PARTITION_ID = "partition-id"       # the node config key (flwr.common.constant.PARTITION_ID_KEY)
QUERY_KEY = "dropfl.partition"      # the record name of the query and of its reply


class NodeMapError(ValueError):
    """The nodes' answers do not make a one-to-one map onto 0..N-1."""


class NodeMap:
    """A one-to-one map between Flower node ids and dropfl partition ids (client indices 0..N-1)."""

    def __init__(self, pairs: Iterable[tuple[int, int]] = ()):
        self._partition: dict[int, int] = {}
        self._node: dict[int, int] = {}
        for node_id, pid in pairs:
            self.learn(node_id, pid)

    def learn(self, node_id: int, partition_id: int) -> None:
        """Record that `node_id` holds `partition_id`; a second node for one partition (or the other way
        round) is a NodeMapError, the same pair again is a no-op."""
        node_id, partition_id = int(node_id), int(partition_id)
        if partition_id < 0:
            raise NodeMapError(f"node {node_id}: partition id {partition_id} is negative")
        if self._partition.get(node_id, partition_id) != partition_id:
            raise NodeMapError(f"node {node_id} answered partition {partition_id}, before {self._partition[node_id]}")
        if self._node.get(partition_id, node_id) != node_id:
            raise NodeMapError(f"partition {partition_id} is held by nodes {self._node[partition_id]} and {node_id}")
        self._partition[node_id], self._node[partition_id] = partition_id, node_id

    def partition(self, node_id: int) -> int:
        """The partition id (dropfl client index) of a Flower node."""
        return self._partition[int(node_id)]

    def node(self, partition_id: int) -> int:
        """The Flower node id holding a partition."""
        return self._node[int(partition_id)]

    def has_node(self, node_id: int) -> bool:
        return int(node_id) in self._partition

    def has_partition(self, partition_id: int) -> bool:
        return int(partition_id) in self._node

    def partitions(self) -> list[int]:
        return sorted(self._node)

    def __len__(self) -> int:
        return len(self._node)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeMap) and self._partition == other._partition

    def __repr__(self) -> str:
        return f"NodeMap({sorted(self._partition.items(), key=lambda kv: kv[1])})"

    def check_complete(self, n_clients: int) -> None:
        """NodeMapError unless the partitions are exactly 0..n_clients-1."""
        have = set(self._node)
        missing, extra = sorted(set(range(n_clients)) - have), sorted(have - set(range(n_clients)))
        if missing or extra:
            raise NodeMapError(f"expected partitions 0..{n_clients - 1}, {len(have)} nodes answered"
                               + (f"; missing {missing[:10]}" if missing else "")
                               + (f"; out of range {extra[:10]}" if extra else ""))

    def to_record(self) -> ConfigRecord:
        """As a ConfigRecord (two int lists), to keep in a ServerApp's `Context.state`."""
        pairs = sorted(self._partition.items())
        return ConfigRecord({"node_ids": [n for n, _ in pairs], "partition_ids": [p for _, p in pairs]})

    @classmethod
    def from_record(cls, record: ConfigRecord) -> NodeMap:
        return cls(zip(record["node_ids"], record["partition_ids"], strict=True))


def partition_of(context: Context) -> int:
    """Client side: this node's partition id, from its node config (Flower's simulation sets it; a deployed
    SuperNode needs `--node-config "partition-id=<i>"`)."""
    try:
        return int(context.node_config[PARTITION_ID])
    except KeyError:
        raise NodeMapError(f"node {context.node_id} has no {PARTITION_ID!r} in its node config; start it with "
                           f"flower-supernode --node-config \"{PARTITION_ID}=<i>\"") from None


def partition_reply(message: Message, context: Context) -> Message:
    """Client side: the answer to `discover`'s query (use as a ClientApp's query handler)."""
    return Message(RecordDict({QUERY_KEY: MetricRecord({PARTITION_ID: partition_of(context)})}), reply_to=message)


def from_reply(message: Message) -> tuple[int, int]:
    """(node id, partition id) of one `partition_reply`."""
    node_id = message.metadata.src_node_id
    if message.has_error():
        raise NodeMapError(f"node {node_id} answered the partition query with an error: {message.error.reason}")
    try:
        return node_id, int(message.content.metric_records[QUERY_KEY][PARTITION_ID])
    except KeyError:
        raise NodeMapError(f"node {node_id}'s reply has no {QUERY_KEY}.{PARTITION_ID} (does its ClientApp "
                           f"answer queries with dropfl.flower.nodes.partition_reply?)") from None


# how long discovery waits for the answers: they include each ClientApp's start (in Flower's simulation, a Ray
# actor importing torch and the app), which takes over a minute on a loaded 2-core machine; a slow answer is not
# a missing node, so the default is generous, and a node that never answers still fails the run with its partition
DISCOVER_TIMEOUT = 300.0


def discover(grid, n_clients: int | None = None, timeout: float = DISCOVER_TIMEOUT, wait: float = 60.0) -> NodeMap:
    """Server side: ask every connected node for its partition id (one `query` message each).

    Waits up to `wait` seconds for `n_clients` nodes to connect (when given), then for up to `timeout`
    seconds for their answers. With `n_clients`, the answers must be exactly partitions 0..n_clients-1."""
    deadline = time.monotonic() + wait
    node_ids = list(grid.get_node_ids())
    while n_clients is not None and len(node_ids) < n_clients and time.monotonic() < deadline:
        time.sleep(0.2)   # nodes still connecting (a deployment); the simulation registers all at once
        node_ids = list(grid.get_node_ids())
    query = [Message(RecordDict({QUERY_KEY: ConfigRecord({"ask": PARTITION_ID})}), dst_node_id=n,
                     message_type=MessageType.QUERY) for n in node_ids]
    replies = list(grid.send_and_receive(query, timeout=timeout))
    nodes = NodeMap(from_reply(m) for m in replies)
    if n_clients is not None:
        nodes.check_complete(n_clients)
    return nodes
