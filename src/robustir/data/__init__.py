"""robustir.data."""
