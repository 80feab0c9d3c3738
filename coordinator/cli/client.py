"""`dropfl client`: one edge agent. The agent lives on the device side (edge_client/agent/), which
never imports `coordinator`; this module only hands it the subcommand."""

from edge_client.agent.cli import add_parser  # noqa: F401
