"""Field mode: the round loop's transport over MQTT. `hub.py` composes the coordinator's MQTT side from
`connection.py` (client, TLS, reconnects), `registry.py` (agents, liveness, data binding, availability) and
`collection.py` (a round's uploads: reassembly, validation via `checks.py` and `sparse.py`); `transport.py`
publishes tasks and models and closes rounds; `netem.py` emulates links; `run.py` runs a field run."""
