"""``robustir audit``: measure how noisy a training set is, list the suspect records, and pick the recipe.

>>> from robustir.audit import AuditConfig, audit
>>> result = audit(AuditConfig(data="train.jsonl", output="audit", eval_data="beir/scifact"))  # doctest: +SKIP
>>> result.estimate["rate"], result.recommendation["loss"]  # doctest: +SKIP
"""

from .estimate import RateEstimate, estimate_rates, random_rate, hard_rate
from .recommend import recommend
from .run import AuditConfig, AuditResult, audit, iter_records

__all__ = ["AuditConfig", "AuditResult", "audit", "iter_records", "RateEstimate", "estimate_rates", "random_rate",
           "hard_rate", "recommend"]
