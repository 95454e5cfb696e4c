"""Statistics and reports of the token-level study: what is read from its stored token and seed rows. It runs
nothing (``compute`` does)."""
