"""Beyond one process on engines people already run: corpus encoding on Ray Data with Lance as the data plane
(:mod:`robustir.scale.ray_encode`; the optional extra ``robustir[scale]``). Training across machines is
``torchrun`` / ``accelerate launch`` (docs/scale.md); the data stages shard with ``--shard I/N``."""
