"""Field mode: the round loop's transport over MQTT. `hub.py` composes the coordinator's MQTT side from explicit
components: `connection.py` (client, TLS, reconnects), `outage.py` (the broker's health), `registry.py` (agents,
liveness, data binding, availability), `collection.py` (a round's uploads: reassembly, validation via `checks.py`
and `sparse.py`) and `absence.py` (an empty federation); `closing.py` is the round-closing rule, a pure function;
`transport.py` publishes tasks and models and closes rounds; `netem.py` emulates links; `run.py` runs a field run."""
