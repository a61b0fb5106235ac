"""robustir.evaluation."""
