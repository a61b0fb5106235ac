"""robustir.cli."""
