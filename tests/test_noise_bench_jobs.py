"""Issue 54: ``noise-bench --jobs`` starts a run only when the device has the memory runs were seen to need.

A simulated GPU (no CUDA, no clock): each started job holds its peak once it has "allocated" (the test decides
when), the probe returns what is free, and ``wait`` finishes the oldest running job."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from robustir.robustness.jobs import MemoryGate, run_gated

GB = 1 << 30


class Device:
    """``total`` bytes; a started job allocates ``peak`` when ``allocate_on_start`` (else only when it finishes:
    the worst case for a gate that trusts the free memory now); ``other`` bytes held by someone else."""

    def __init__(self, total: int, peak: int, allocate_on_start: bool = False, other: int = 0) -> None:
        self.total, self.peak, self.allocate_on_start, self.other = total, peak, allocate_on_start, other
        self.running: list[Future] = []
        self.most_at_once = 0
        self.order: list[str] = []

    def free(self) -> int:
        held = self.peak * len(self.running) if self.allocate_on_start else 0
        return self.total - self.other - held

    def start(self, item: str) -> Future:
        future: Future = Future()
        self.running.append(future)
        self.most_at_once = max(self.most_at_once, len(self.running))
        self.order.append(item)
        assert self.free() >= 0, "out of memory"
        future.item = item  # type: ignore[attr-defined]
        return future

    def wait(self, futures: set[Future]) -> set[Future]:
        oldest = next(f for f in self.running if f in futures)
        self.running.remove(oldest)
        oldest.set_result({"item": oldest.item, "peak_gpu_bytes": self.peak})  # type: ignore[attr-defined]
        return {oldest}


def _run(device: Device, gate: MemoryGate, items: list[str], jobs: int) -> list[str]:
    finished = []
    for item, future in run_gated(items, device.start, jobs, gate, wait=device.wait):
        row = future.result()
        gate.observe(row["peak_gpu_bytes"])
        finished.append(item)
    return finished


@pytest.mark.parametrize("allocate_on_start", [True, False])
def test_an_80_gb_device_runs_as_many_8_5_gb_runs_as_fit_never_more(allocate_on_start):
    """The H100 case of issue 54: 14 jobs of ~8.5 GB asked for at once; with a 1 GB margin 8 fit in 79 GB."""
    device = Device(total=79 * GB, peak=int(8.5 * GB), allocate_on_start=allocate_on_start)
    gate = MemoryGate(free_memory=device.free, margin=GB)
    items = [f"run{i}" for i in range(14)]
    assert sorted(_run(device, gate, items, jobs=14)) == sorted(items)
    assert device.order == items
    assert device.most_at_once == 79 // 9.5 == 8


def test_a_fresh_bench_runs_one_alone_to_learn_what_a_run_needs():
    device = Device(total=79 * GB, peak=20 * GB)
    gate = MemoryGate(free_memory=device.free, margin=GB)
    concurrency = []
    original = device.start

    def start(item):
        future = original(item)
        concurrency.append(len(device.running))
        return future

    device.start = start  # type: ignore[method-assign]
    _run(device, gate, ["a", "b", "c", "d", "e"], jobs=4)
    assert concurrency[:2] == [1, 1]  # b waited for a's peak
    assert max(concurrency) == 3  # then 79 // 21
    assert gate.seen == 20 * GB


def test_peaks_of_earlier_rows_start_in_parallel_at_once():
    device = Device(total=40 * GB, peak=9 * GB)
    gate = MemoryGate(free_memory=device.free, margin=GB, seen=9 * GB)
    starts = []
    original = device.start
    device.start = lambda item: (starts.append(len(device.running)), original(item))[1]  # type: ignore
    _run(device, gate, ["a", "b", "c", "d", "e", "f"], jobs=6)
    assert starts[:4] == [0, 1, 2, 3] and device.most_at_once == 4


def test_memory_taken_by_another_process_meanwhile_counts():
    """The baseline was measured before another process took 50 GB: the free memory now limits the starts."""
    device = Device(total=79 * GB, peak=8 * GB, allocate_on_start=True)
    gate = MemoryGate(free_memory=device.free, margin=GB, seen=8 * GB)
    original = device.start

    def start(item):
        future = original(item)
        device.other = 50 * GB  # arrives after our first start
        return future

    device.start = start  # type: ignore[method-assign]
    _run(device, gate, [str(i) for i in range(6)], jobs=6)
    assert device.most_at_once == 29 // 9 == 3


def test_without_cuda_every_job_is_admitted_up_to_jobs():
    device = Device(total=0, peak=0)
    gate = MemoryGate(free_memory=lambda: None)
    _run(device, gate, [str(i) for i in range(7)], jobs=3)
    assert device.most_at_once == 3


def test_a_run_too_big_for_the_device_still_runs_alone():
    """Nothing of ours running: the job starts (it raises its own error if it cannot fit), never a hang."""
    device = Device(total=4 * GB, peak=8 * GB)
    gate = MemoryGate(free_memory=device.free, margin=GB, seen=8 * GB)
    assert _run(device, gate, ["a", "b"], jobs=2) == ["a", "b"] and device.most_at_once == 1


def test_the_gate_starts_from_the_largest_peak_of_earlier_rows_of_the_same_budget(tmp_path):
    import json
    from dataclasses import asdict

    from robustir.robustness.bench import _Bench
    from robustir.robustness.sidebyside import Budget

    bench = _Bench.__new__(_Bench)  # only what memory_gate() reads
    bench.results_path, bench.budget = tmp_path / "results.jsonl", Budget()
    same, other = asdict(Budget()), asdict(Budget(epochs=3.0))
    rows = [{"cell": "a", "budget": same, "peak_gpu_bytes": 3 * GB},
            {"cell": "b", "budget": same, "peak_gpu_bytes": 5 * GB},
            {"cell": "c", "budget": other, "peak_gpu_bytes": 70 * GB},
            {"cell": "d", "budget": same, "peak_gpu_bytes": None}]
    bench.results_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.memory_gate().seen == 5 * GB
