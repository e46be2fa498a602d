"""Privacy auditing: empirical ε lower bounds from membership inference (De et al., App. A.2).

A DP guarantee holds only if the code is right. An audit trains many models on a small
dataset D and many on D' = D ∪ {z} for a canary z, and turns how well the loss of z tells the
two apart into a statistically valid *lower* bound on ε (Clopper-Pearson, Tramèr et al.
2022). A lower bound above the claimed ε proves a bug; one below it is evidence, not proof,
that the implementation keeps its promise.

>>> from dpvision.audit import advantage_upper_bound
>>> round(advantage_upper_bound(2.0, 0.01), 2)
0.76

* :func:`run_audit` — the two-phase procedure (``dpvision audit`` on the command line);
* :mod:`dpvision.audit.statistics` — Clopper-Pearson bounds, threshold selection, AUC;
* :mod:`dpvision.audit.one_run` — the ε lower bound of one training run with m canaries
  (Steinke, Nasr & Jagielski 2023), from the canaries' scores and inclusion coins;
* :func:`audit_training` — that bound for any training function (your own model and
  PrivacyEngine loop), in one call;
* :func:`run_one_run_audit` — that bound for dpvision's own training paths (``dpvision
  audit --one-run``), with white-box Dirac canaries scored on the released values
  (:mod:`dpvision.audit.one_run_targets`) or black-box mislabeled images;
* :mod:`dpvision.audit.targets` — the trainings audited, through the code users run;
* :mod:`dpvision.audit.canaries` — D and the canaries (blank, noise, mislabeled).
"""

from dpvision.audit.canaries import CANARIES, AuditData, make_audit_data
from dpvision.audit.harness import (
    AUDIT_DEFAULTS,
    DEFAULT_SWEEPS,
    AuditSettings,
    audit_config,
    parse_sweep,
    run_audit,
    summary,
)
from dpvision.audit.one_run import (
    audit_one_run,
    guesses_from_scores,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)
from dpvision.audit.one_run_harness import (
    OneRunSettings,
    one_run_config,
    one_run_summary,
    run_one_run_audit,
)
from dpvision.audit.one_run_training import audit_training, negative_loss
from dpvision.audit.statistics import (
    AuditStatistics,
    advantage_upper_bound,
    audit_scores,
    clopper_pearson,
    epsilon_lower_bounds,
    gaussian_tv_distance,
    membership_auc,
)

__all__ = [
    "AUDIT_DEFAULTS",
    "CANARIES",
    "DEFAULT_SWEEPS",
    "AuditData",
    "AuditSettings",
    "AuditStatistics",
    "OneRunSettings",
    "advantage_upper_bound",
    "audit_config",
    "audit_one_run",
    "audit_scores",
    "audit_training",
    "clopper_pearson",
    "epsilon_lower_bounds",
    "gaussian_tv_distance",
    "guesses_from_scores",
    "make_audit_data",
    "membership_auc",
    "negative_loss",
    "one_run_config",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
    "one_run_summary",
    "parse_sweep",
    "run_audit",
    "run_one_run_audit",
    "summary",
]
