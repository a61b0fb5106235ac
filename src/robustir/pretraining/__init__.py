"""Retrieval-oriented pre-training: RetroMAE (masked auto-encoder with an enhanced decoder) and GUR (span MLM +
in-pair contrastive on LCS-mined pairs), on streamed raw text, one process or many (``robustir pretrain``)."""
