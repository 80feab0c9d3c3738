"""dropfl coordinator: round loop, strategies, availability, transports, run directories."""
