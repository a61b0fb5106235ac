"""Mining's search on Lance and lance-ray against FAISS (issue 53): what `--ray-search-shards` and
`--ray-lance-index` use, and why.

    python bench/lance_search.py --rows 20000 --queries 100

Random unit vectors (384 dims; the search's speed does not depend on the model), queries near corpus rows; top 105
(mining's 100 + the tie margin), inner product:
* `faiss.knn` on 1 thread over the query batch -- the kernel each search shard runs (`scale/ray_search.py`);
* Lance's exact `to_table(nearest=..., metric="dot")`, one query a call (Lance takes one query vector);
* lance-ray's `vector_search` (2 workers), one query a call, on --lr-queries queries (it is slow);
* an IVF_PQ index built by lance-ray's distributed `create_index` (2 workers), searched with Lance's `nearest`
  (nprobes 16, refine 10) and with `vector_search`: recall@100 against the exact top 100.
Prints ms per query and whether the exact ones found FAISS's top-100 set, with the largest score difference.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--lr-queries", type=int, default=5)
    args = parser.parse_args()
    import faiss
    import lance
    import lance_ray
    import pyarrow as pa
    import ray

    dim, k = 384, 105
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = (x[rng.choice(args.rows, args.queries, replace=False)]
         + 0.3 * rng.standard_normal((args.queries, dim), dtype=np.float32)).astype(np.float32)
    uri = tempfile.mkdtemp() + "/v.lance"
    lance.write_dataset(pa.table({"id": [f"{i:012d}" for i in range(args.rows)],
                                  "vector": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), dim)}),
                        uri, max_rows_per_file=8192)
    faiss.omp_set_num_threads(1)
    start = time.perf_counter()
    exact_scores, exact_rows = faiss.knn(q, x, k, metric=faiss.METRIC_INNER_PRODUCT)
    print(f"faiss.knn, 1 thread, batched: {(time.perf_counter() - start) / args.queries * 1e3:.2f} ms/query")

    def run(name: str, search, queries: int) -> None:
        start, same, diff, recall = time.perf_counter(), 0, 0.0, 0.0
        for i in range(queries):
            found = search(q[i])
            rows = np.asarray([int(v) for v in found.column("id").to_pylist()])
            scores = 1.0 - np.asarray(found.column("_distance"))  # Lance's dot distance is 1 - inner product
            same += set(rows[:100]) == set(exact_rows[i][:100])
            recall += len(set(rows[:100]) & set(exact_rows[i][:100])) / 100
            diff = max(diff, float(np.abs(scores[:len(rows)] - exact_scores[i][:len(rows)]).max()))
        print(f"{name}: {(time.perf_counter() - start) / queries * 1e3:.1f} ms/query, same top-100 set "
              f"{same}/{queries}, recall@100 {recall / queries:.3f}, max |score diff| {diff:.1e}")

    nearest = lambda v, **kw: {"column": "vector", "q": v, "k": k, "metric": "dot", **kw}  # noqa: E731
    dataset = lance.dataset(uri)
    run("lance nearest, exact", lambda v: dataset.to_table(nearest=nearest(v), columns=["id"]), args.queries)
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    run("lance_ray.vector_search, exact", lambda v: lance_ray.vector_search(
        uri, nearest=nearest(v), columns=["id"], num_workers=2), args.lr_queries)
    start = time.perf_counter()
    lance_ray.create_index(uri, "vector", "IVF_PQ", metric="dot", num_workers=2,
                           num_partitions=int(4 * np.sqrt(args.rows)), num_sub_vectors=dim // 8,
                           sample_rate=min(256, args.rows // 256, args.rows // int(4 * np.sqrt(args.rows))))
    print(f"lance_ray.create_index IVF_PQ (2 workers): {time.perf_counter() - start:.1f} s")
    dataset = lance.dataset(uri)
    run("IVF_PQ, lance nearest", lambda v: dataset.to_table(
        nearest=nearest(v, nprobes=16, refine_factor=10), columns=["id"]), args.queries)
    run("IVF_PQ, lance_ray.vector_search", lambda v: lance_ray.vector_search(
        uri, nearest=nearest(v, nprobes=16, refine_factor=10), columns=["id"], num_workers=2), args.lr_queries)


if __name__ == "__main__":
    main()
