"""robustir.index."""
