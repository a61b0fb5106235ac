"""robustir.mining."""
