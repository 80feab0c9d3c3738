"""`python -m coordinator.cli ...` is `dropfl ...` (trial starts its coordinator and agents this way)."""

import sys

from coordinator.cli import main

sys.exit(main())
