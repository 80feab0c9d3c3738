"""`python -m edge_client.agent --config FILE [--log-level LEVEL]`: run one edge agent."""

import sys

from edge_client.agent.cli import main

sys.exit(main())
