"""What the commands do, each a short function over the layers below.

* :mod:`dpvision.runs.train` — ``dpvision train``: :func:`run_training`, its summary, and
  ``dpvision.train`` for Python;
* :mod:`dpvision.runs.features` — feature learners on (private) features;
* :mod:`dpvision.runs.dpsgd` — DP-SGD and DP-RandP on deep models;
* :mod:`dpvision.runs.transfer` — DP-RandP's encoder (made by Phase I when missing) and phase split;
* :mod:`dpvision.runs.saved` — a trained model in one file (``--save``), loaded again for
  ``dpvision predict`` and ``evaluate``.
"""
