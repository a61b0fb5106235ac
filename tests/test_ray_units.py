"""Issue 53: the Ray engine's bookkeeping that needs no Ray cluster (so it runs where Ray is not installed)."""

from __future__ import annotations

from robustir.scale.ray_encode import _Ledger


def test_the_ledger_names_the_batch_whose_actor_died_not_one_only_interrupted():
    """A poison batch kills actor A three times (two restarts, then the job fails); meanwhile another batch, earlier
    by name, was started three times on actor B and interrupted each time without its actor dying (Ray Data
    retried it, then shut the pool down). Counting unfinished starts tied them and named the earlier one."""
    ledger = _Ledger()
    ledger.loaded("A")
    ledger.loaded("B")
    for attempt in range(3):
        ledger.started("d000 .. d009 (10 rows)", "B")  # interrupted, never finished, B alive
        ledger.started("d010 .. d019 (10 rows)", "A")  # A dies running it
        if attempt < 2:
            ledger.loaded("A")  # Ray restarted A under the same id
    assert ledger.worst() == ("d010 .. d019 (10 rows)", 3)
    assert ledger.model_loads() == 4


def test_the_ledger_forgets_finished_batches_and_breaks_ties_by_name():
    ledger = _Ledger()
    assert ledger.worst() is None
    ledger.started("b", "A")
    ledger.finished("b", "A")
    assert ledger.worst() is None  # finished: nothing against it
    for actor, batch in (("A", "y"), ("B", "x")):  # each killed its actor once, then the job failed
        ledger.started(batch, actor)
        ledger.loaded(actor)
    assert ledger.worst() == ("x", 1)  # a tie (same deaths, same tries): the first by name, whatever the order


def test_autoscaling_bounds_are_checked_at_load():
    """The encoder pool's bounds (``concurrency`` .. ``max_concurrency``; mining's ``ray_actors`` ..
    ``ray_max_actors``): inverted bounds and misspelt keys are refused when the config is made, not on the cluster."""
    import pytest

    from robustir.errors import ConfigError
    from robustir.negatives.mining import MiningConfig
    from robustir.scale.ray_encode import RayEncodeConfig

    assert RayEncodeConfig(concurrency=2, max_concurrency=4).max_concurrency == 4
    with pytest.raises(ConfigError, match=r"max_concurrency \(2\) is below concurrency \(3\)"):
        RayEncodeConfig(concurrency=3, max_concurrency=2)
    with pytest.raises(ConfigError, match="did you mean 'max_concurrency'"):
        RayEncodeConfig(max_concurency=2)
    with pytest.raises(ConfigError, match="did you mean 'ray_max_actors'"):
        MiningConfig(method="dense", engine="ray", ray_max_actor=2)
    with pytest.raises(ConfigError, match=r"ray_max_actors \(1\) is below ray_actors \(2\)"):
        MiningConfig(method="dense", engine="ray", ray_actors=2, ray_max_actors=1).validate()
    with pytest.raises(ConfigError, match="ray_max_actors goes with engine: ray"):
        MiningConfig(method="dense", ray_max_actors=2).validate()
    MiningConfig(method="dense", engine="ray", ray_actors=1, ray_max_actors=3).validate()


def test_a_large_jsonl_is_cut_into_ranges_of_whole_lines(tmp_path):
    """The ranges several Ray tasks read a large JSONL by: they cover the file, each starts on a line, and the
    lines they hold are the file's, each once, in order (a long line is never cut)."""
    from robustir.scale.ray_inputs import _jsonl_ranges

    lines = [f'{{"_id": "d{i}", "text": "{"word " * (i % 37)}"}}' for i in range(500)]
    path = tmp_path / "big.jsonl"
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(data)
    ranges = _jsonl_ranges(str(path), None, 1000)
    assert len(ranges) > 10 and ranges[0]["start"] == 0 and ranges[-1]["stop"] == len(data)
    assert all(a["stop"] == b["start"] for a, b in zip(ranges, ranges[1:]))
    assert all(data[r["start"] - 1:r["start"]] == b"\n" for r in ranges[1:])
    read = [line for r in ranges for line in data[r["start"]:r["stop"]].decode().split("\n") if line]
    assert read == lines
    assert _jsonl_ranges(str(path), None, 10 ** 9) == [{"path": str(path), "start": 0, "stop": len(data)}]
