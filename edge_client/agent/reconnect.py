"""How an MQTT client of dropfl (the agent, and the coordinator: coordinator/field/connection.py) reconnects.

paho reconnects by itself, with a delay that doubles from `min_delay` to `max_delay` and is reset by every
successful CONNACK. Two things that fail with that alone, measured on a 3-node RabbitMQ 3.10 cluster
(benchmarks/results/field_cluster.md):

1. **A clean session's QoS 1 subscription queue is homed on one node.** When that node is killed, a client that
   was on it connects to a live node (CONNACK: accepted) and is dropped as soon as it subscribes (`home node
   ... of durable queue ... is down`), on every node, until the dead node returns. Because the CONNACK reset
   paho's delay, it retried every ~0.2 s (96 connects in 20 s for one probe client). A fresh client id gets a
   new queue on the live node and works at once; dropfl's sessions are clean, so nothing is lost by it that
   the protocol does not already re-send (docs/protocol.md). (In some runs RabbitMQ instead force-deletes
   the old queue when the client reconnects; then the old id is accepted and no fresh one is needed.)
2. **No jitter**: a fleet cut off at one instant retries in lockstep.

`Reconnect` keeps its own backoff: full jitter, a delay drawn uniformly from [min_delay, min(max_delay,
min_delay · 2^k)] where k counts consecutive failed attempts (1 after a healthy connection drops), reset
only once a connection is healthy (its subscription answered: SUBACK), not on a CONNACK. A connection that
the broker dropped after its CONNACK but before acknowledging the subscription makes the next attempt use a
fresh client id (`<base>-r<n>`).
A broker that maps client ids to usernames (mosquitto's `use_username_as_clientid`, provisioning/broker.py)
is unaffected. `max_delay` stays at paho's former 2 s: the coordinator awaits agents after a broker outage
for AGENT_RECONNECT_S (coordinator/field/outage.py) plus a heartbeat timeout. It drives paho through
`reconnect_delay_set` (the next wait) and paho's `_client_id` (the id of the next CONNECT), as
`Brokers.rotate` drives its host and port.
"""

from __future__ import annotations

import random

from paho.mqtt import client as mqtt


class Reconnect:
    def __init__(self, base_id: str, min_delay: float = 0.2, max_delay: float = 2.0, rng: random.Random | None = None):
        self.base_id, self.min_delay, self.max_delay = base_id, min_delay, max_delay
        self.rng = rng or random.Random()
        self.generation = 0       # client ids used so far beyond the first
        self.failures = 0         # consecutive attempts that did not end in a healthy connection
        self.reconnects = 0       # disconnects and failed connects since the start (for tests and logs)
        self.fresh_ids = 0        # times a fresh client id was taken
        self.connected = False    # CONNACK received on the current connection
        self.healthy = False      # and its subscription acknowledged
        self.sub_mid: int | None = None
        self.token = f"{self.rng.getrandbits(32):08x}"  # this process (a restarted one starts over)
        self.sessions = 0         # CONNACKs so far: with `token`, names the connection a status was sent on

    @property
    def client_id(self) -> str:
        return self.base_id if self.generation == 0 else f"{self.base_id}-r{self.generation}"

    def delay(self) -> float:
        cap = min(self.max_delay, self.min_delay * 2 ** min(self.failures, 30))
        return self.rng.uniform(self.min_delay, max(cap, self.min_delay))

    # --- paho's network thread ---
    def on_connect(self, mid: int | None) -> None:
        """CONNACK accepted and the subscription sent (its message id `mid`)."""
        self.connected, self.healthy, self.sub_mid = True, False, mid
        self.sessions += 1

    def on_subscribe(self, mid: int) -> bool:
        """True when this SUBACK makes the connection healthy: the broker answered the subscription sent on
        connect (a refused topic, e.g. by an ACL, is the broker's answer too; RabbitMQ's home-node refusal
        sends none and drops the connection)."""
        if mid != self.sub_mid or self.healthy:
            return False
        self.healthy, self.failures = True, 0
        return True

    def on_lost(self, client: mqtt.Client) -> str | None:
        """A disconnect or a failed connect: set paho's next wait (jittered backoff) and, after a connection
        dropped before its subscription was acknowledged, a fresh client id. Returns the new id, or None."""
        self.reconnects += 1
        fresh = None
        if self.connected and not self.healthy:
            self.generation += 1
            self.fresh_ids += 1
            fresh = self.client_id
            client._client_id = fresh.encode()
        self.failures = 1 if self.healthy else self.failures + 1
        self.connected = self.healthy = False
        self.sub_mid = None
        client.reconnect_delay_set(min_delay=(d := self.delay()), max_delay=d)
        return fresh
