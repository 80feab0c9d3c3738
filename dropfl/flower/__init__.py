"""dropfl inside Flower (the optional extra `dropfl[flower]`, flwr 1.41's Message API).

    dropfl.flower.nodes      Flower node ids ↔ dropfl client indices (partition ids)
    dropfl.flower.strategy   DropflStrategy: any registered dropfl strategy as a Flower strategy
    dropfl.flower.client     dropfl's local training as a Flower ClientApp
"""

from dropfl.flower.availability import WithDropouts
from dropfl.flower.nodes import NodeMap, discover, partition_reply
from dropfl.flower.strategy import DropflStrategy, model_arrays, to_arrays, to_vector

__all__ = ["DropflStrategy", "NodeMap", "discover", "model_arrays", "partition_reply", "to_arrays", "to_vector",
           "WithDropouts"]
