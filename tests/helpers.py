"""Helpers shared by several test modules (imported as ``from helpers import ...``; tests/ is on sys.path)."""

from __future__ import annotations

import gc
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

try:  # the HTTP client the installed openai package uses (httpx2 with openai >= 3, httpx before); the server tests
    import httpx2 as httpx  # noqa: F401  import it from here
except ImportError:  # pragma: no cover
    import httpx  # noqa: F401

# a six-document corpus and four queries (query i is about document i) for tiny BEIR folders and training files
DOCS = [("d1", "Aspirin", "Aspirin reduces the risk of heart attacks in adults."),
        ("d2", "Statins", "Statins lower cholesterol and cardiovascular events."),
        ("d3", "Vitamin D", "Vitamin D supports bone health in older people."),
        ("d4", "Exercise", "Regular exercise improves sleep quality and mood."),
        ("d5", "Coffee", "Coffee consumption is linked to alertness and lower fatigue."),
        ("d6", "Sleep", "Short sleep increases the risk of obesity in children.")]
QUERIES = [("q1", "does aspirin prevent heart attacks"), ("q2", "do statins reduce cholesterol"),
           ("q3", "is vitamin d good for bones"), ("q4", "does exercise help sleep")]


def scifact_with_planted_positives(scifact_dir, path, n: int, planted: int) -> set[int]:
    """``n`` SciFact training queries with their positives and 3 random negatives each, written to ``path``;
    ``planted`` of them (seeded) get a random corpus passage as their positive instead. Returns their indexes."""
    import json
    import random

    from robustir.data.beir import load_beir

    data = load_beir(scifact_dir, "train")
    texts = dict(zip(data.corpus.ids, data.corpus.texts_for_encoding()))
    rng = random.Random(0)
    qids = sorted(data.qrels)[:n]
    wrong = set(rng.sample(range(n), planted))
    others = list(texts)
    lines = []
    for i, qid in enumerate(qids):
        positives = [texts[d] for d in data.qrels[qid]]
        if i in wrong:
            positives = [texts[rng.choice(others)]]
        negatives = [texts[rng.choice(others)] for _ in range(3)]
        lines.append(json.dumps({"query": data.queries[qid], "pos": positives, "neg": negatives}))
    path.write_text("\n".join(lines) + "\n")
    return wrong


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (numel) any op produces, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


def multiprocess_engine_step(model, engine, a_rows, b_rows, use_ddp: bool, world: int, k: int = 0, *,
                             backward: bool = True, find_unused_parameters: bool = True, **step_kwargs):
    """One :class:`BatchEngine` step inside an initialised process group, as multi-process training runs it:
    through DDP (as accelerate prepares it; ``backward=False`` runs the backward afterwards, from inside autograd),
    or on the bare model with its gradients all-reduced by hand (what DDP does: the mean over the processes).
    ``k`` and ``step_kwargs`` (``passage_ids``) go to the step. Returns the step's output and its loss averaged
    over the processes (float64)."""
    import torch.distributed as dist
    from torch import nn

    if use_ddp:
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused_parameters)
        out = engine.step(ddp, a_rows, b_rows, k, backward=backward, **step_kwargs)
        if not backward:
            out.loss.backward()
    else:
        out = engine.step(model, a_rows, b_rows, k, **step_kwargs)
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world
    value = out.loss.detach().clone().double()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return out, value / world


def gloo_process(rank: int, world: int, init_file: str, out_file: str, body: Callable[[int], dict]) -> None:
    """One rank of a two-process CPU test: join a gloo group through ``init_file``, save ``body(rank)`` to
    ``out_file``, and leave no gloo object alive at interpreter exit.

    ``body`` runs in its own frame so that its models (DistributedDataParallel holds the process group, and its
    hooks make reference cycles) are gone, cycles collected, before the group is destroyed. A group still
    referenced at exit is torn down by C++ static destructors, which aborted one process in about 40 runs
    ("terminate called without an active exception", SIGABRT after both ranks had saved their results; seen in CI
    and reproduced here with both cores loaded)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ok = False
    try:
        torch.save(body(rank), out_file)
        ok = True
    finally:
        gc.collect()
        if ok:  # every rank is here: none tears down while another still talks to it
            dist.barrier()
        dist.destroy_process_group()
        gc.collect()


def moto_s3(bucket: str):
    """moto's S3 server in a thread on 127.0.0.1 (a free port) with one bucket: a context manager giving its URL.
    Needs ``moto[server]`` (``robustir[dev]``)."""
    import contextlib
    import logging

    import boto3
    from moto import server as moto_server

    @contextlib.contextmanager
    def running():
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        try:
            boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                         region_name="us-east-1").create_bucket(Bucket=bucket)
            yield url
        finally:
            server.stop()

    return running()
