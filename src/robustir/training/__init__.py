"""robustir.training."""
