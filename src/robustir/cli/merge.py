"""``robustir merge``: join the shards of a stage into one file, after checking that all of them are complete.

Example::

    for i in 1 2 3 4; do robustir mine --data ../shared/data/scifact --output runs/mined.jsonl --shard $i/4 & done; wait
    robustir merge --output runs/mined.jsonl     # -> runs/mined.jsonl + runs/mined.jsonl.report.json
"""

from __future__ import annotations

from ..outputs import StageOutput


def command(*, output: str, shards: int | None = None, allow_failures: bool = False) -> int:
    """Merge the shards of a stage after checking they are all complete.

    Parameters
    ----------
    output
        the un-sharded output name the stage was given (its shards are found next to it)
    shards
        number of shards N (default: from the file names)
    allow_failures
        merge shards whose .failed.jsonl lists items still to retry (generate)
    """
    result = StageOutput(output).merge(shards, allow_failures)
    extra = f" and {result.report.name}" if result.report else ""
    print(f"robustir merge: {result.shards} shards, {result.lines} lines -> {result.output}{extra}")
    return 0
