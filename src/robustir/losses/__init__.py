"""robustir.losses."""
