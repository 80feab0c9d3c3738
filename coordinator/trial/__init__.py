"""One-machine field trials: a private (or provisioned, TLS) broker, N agent processes and the coordinator
(`run.py`), the private mosquitto (`broker.py`), TLS bundles for the agents (`tls.py`)."""
