"""Robustness: planted-noise benchmark, fair side-by-side with sentence-transformers."""
