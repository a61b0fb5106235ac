"""False-negative (and false-positive) removal after mining: teacher margin, CCR passage sieve, PEG's LLM judge."""
