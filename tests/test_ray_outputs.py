"""Issue 53: where the Ray engine reads and writes. ``encode --engine ray --output s3://...`` on a local S3 endpoint
(moto's server on 127.0.0.1): the vectors of a local run read back from the bucket, the record and the writer lease
on S3 (a second driver refused naming the first), nothing written locally, the corpus itself read from S3; and on a simulated two-node Ray cluster whose
actors work in another folder than the driver, relative inputs and outputs land where the driver meant them, and a
path a node cannot see is refused naming it. Skipped without ``robustir[scale]`` (and moto for S3)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from extras import require  # noqa: E402  (tests/ is on sys.path)

require("ray", "ray.data", "lance", "lance_ray", extra="scale")
import ray  # noqa: E402

from robustir.errors import ConfigError  # noqa: E402
from robustir.scale.ray_encode import encode_with_ray, read_vectors  # noqa: E402
from test_ray_engine import _config, _corpus  # noqa: E402  (tests/ is on sys.path)

BUCKET = "robustir-ray"


@pytest.fixture()
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture()
def endpoint():
    require("boto3", "moto.server", extra="dev")
    from helpers import moto_s3

    with moto_s3(BUCKET) as url:
        yield url


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
    assert re.search(r"30 rows in \d+ parts", capsys.readouterr().out)
    ids, vectors = read_vectors(uri, options)
    local_ids, local_vectors = read_vectors(tmp_path / "local.lance")
    assert ids == local_ids == [f"d{i:03d}" for i in range(30)] and local.rows == 30
    np.testing.assert_allclose(vectors, local_vectors, atol=1e-6)
    assert not (tmp_path / "s3:").exists() and not list(tmp_path.glob("s3*"))  # nothing written beside the driver
    assert main(args) == 0 and "nothing to do" in capsys.readouterr().out  # the record is on S3
    import boto3  # the corpus itself on S3: read by Ray tasks with the same options

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").upload_file(str(corpus), BUCKET, "in/corpus.jsonl")
    streamed = encode_with_ray(f"s3://{BUCKET}/in/corpus.jsonl", tiny_model_dir, f"s3://{BUCKET}/runs/s3.lance",
                               config=_config(), storage_options=options)
    assert streamed.rows == 30
    np.testing.assert_allclose(read_vectors(f"s3://{BUCKET}/runs/s3.lance", options)[1], local_vectors, atol=1e-6)
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


@pytest.fixture()
def two_nodes(tmp_path):
    """A simulated two-node Ray cluster (one CPU each) whose workers start in another folder than the driver's:
    the job's ``runtime_env`` working_dir, as on a real cluster."""
    from ray.cluster_utils import Cluster

    elsewhere = tmp_path / "cluster-working-dir"
    elsewhere.mkdir()
    (elsewhere / "README").write_text("the actors' working folder\n")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    import robustir

    source = str(Path(robustir.__file__).resolve().parents[1])  # this checkout's robustir, from any folder
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"working_dir": str(elsewhere), "env_vars": {"PYTHONPATH": source}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_relative_paths_land_where_the_driver_meant_on_a_two_node_cluster(tmp_path, tiny_model_dir, two_nodes,
                                                                          monkeypatch):
    """Relative --input, --model and --output, from a driver whose folder is not the actors': the actors (one per
    node, in the runtime_env's working folder) read the input and model and write the data files under the driver's
    folder, where the commit and the record are (before issue 53 the data files went to the actors' folder and the
    dataset read back "Not found"); the index's encoder pool takes a relative model too; a path no node sees is
    refused naming the node and the path."""
    import shutil

    from robustir.models.encoder import Encoder
    from robustir.scale.job import check_cluster_sees
    from robustir.scale.ray_encode import RayEncoderPool

    driver = tmp_path / "driver"
    driver.mkdir()
    shutil.copytree(tiny_model_dir, driver / "model")
    _corpus(driver / "corpus.jsonl", 30)
    monkeypatch.chdir(driver)
    nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 2

    report = encode_with_ray("corpus.jsonl", "model", "out/v.lance", config=_config(concurrency=2))
    assert report.rows == 30
    ids, vectors = read_vectors(driver / "out" / "v.lance")
    assert ids == [f"d{i:03d}" for i in range(30)] and vectors.shape == (30, 32)
    record = json.loads((driver / "out" / "v.lance.run.json").read_text())
    assert str(driver / "corpus.jsonl") in json.dumps(record["fingerprint"])  # recorded absolute
    session_dirs = Path(ray._private.worker._global_node.get_session_dir_path())
    assert not list(session_dirs.rglob("*.lance"))  # nothing written in the actors' working folders

    texts = [f"passage {i} about topic {i % 5}" for i in range(12)]
    encoder = Encoder.from_pretrained("model")
    pool = RayEncoderPool(encoder, actors=2)
    try:
        got = pool.encode(texts, "passage", batch_size=4, precision="fp32")
    finally:
        pool.close()
    np.testing.assert_allclose(got, encoder.encode(texts, "passage", batch_size=4, precision="fp32"), atol=1e-5)

    # what the driver sees but the actors do not (here: paths relative to the driver's folder) is refused
    with pytest.raises(ConfigError, match=r"node [\d.]+ does not see the input corpus\.jsonl, the output folder "
                                          r"out; node [\d.]+ does not see .* put them on storage every node mounts"):
        check_cluster_sees({"input": "corpus.jsonl"}, "out/w.lance")
    with pytest.raises(ConfigError, match=r"does not see the model folder /nowhere/model"):
        check_cluster_sees({"model folder": "/nowhere/model"})
