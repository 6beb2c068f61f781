"""Pure policy: where units go. No Ray, no I/O: decisions from plain data."""
