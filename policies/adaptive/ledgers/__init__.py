"""What the adaptive policy remembers of its own recent placements, one ledger per concern."""
