"""robustir.models."""
