"""Availability: who can take part in a round and why not. `models.py`: the papers' synthetic models;
`participation.py`: the participation log a run writes and its exact replay; `traces.py`: device time series
(battery, charging, links) on a virtual clock, and the FedScale importer."""
