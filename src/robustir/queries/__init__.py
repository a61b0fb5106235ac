"""Training pairs from raw text: LLM-generated queries (PEG, ``generate``) and GUR's LCS sentence pairs (``pairs``)."""
