"""robustir: train robust dense text-retrieval embedding models on noisy data (PEG, CCR, GUR)."""

__version__ = "0.1.0"
