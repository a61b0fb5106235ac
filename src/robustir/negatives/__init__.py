"""Hard-negative mining (BM25 or dense, ``mining``) and the false-negative margin rule it shares with the filters."""
