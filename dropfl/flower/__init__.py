"""dropfl inside Flower (the optional extra `dropfl[flower]`, flwr 1.41's Message API).

    dropfl.flower.nodes      Flower node ids ↔ dropfl client indices (partition ids)
    dropfl.flower.strategy   DropflStrategy: any registered dropfl strategy as a Flower strategy
"""
