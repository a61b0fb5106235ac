"""One artifact layer: what an output depends on (:mod:`~robustir.runs.fingerprint`) and whether it is done with
those settings and inputs (:mod:`~robustir.runs.artifact`). Every stage, the runner, the training run folder, the
Arrow cache, the sieve's work model and the noise bench's cells ask here; nothing else names a completion
sidecar or computes a fingerprint."""

from .artifact import RECORD, Artifact, Check, Decision, file_sha256
from .fingerprint import (OPERATIONAL, Fingerprint, added, digest_inputs, fingerprint, is_operational, operational,
                          settings_of)
from .step import STEPS, Job, Step, StepResult, execute, register

__all__ = ["Artifact", "added", "Check", "Decision", "Fingerprint", "OPERATIONAL", "RECORD", "digest_inputs", "file_sha256",
           "fingerprint", "is_operational", "operational", "settings_of", "STEPS", "Job", "Step", "StepResult",
           "execute", "register"]
