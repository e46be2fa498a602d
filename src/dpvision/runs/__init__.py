"""What the commands do, each a short function over the layers below.

* :mod:`dpvision.runs.train` — ``dpvision train``: :func:`run_training`, its summary, and
  ``dpvision.train`` for Python;
* :mod:`dpvision.runs.features` — feature learners on (private) features;
* :mod:`dpvision.runs.dpsgd` — DP-SGD and DP-RandP on deep models, composed from:
  :mod:`dpvision.runs.inputs` (the split and the model inputs),
  :mod:`dpvision.runs.schedule` (seeds, steps, q, σ and the validation counts) and
  :mod:`dpvision.runs.network` (the initial and the released network);
* :mod:`dpvision.runs.transfer` — DP-RandP's encoder (made by Phase I when missing) and phase split;
* :mod:`dpvision.runs.tune` — ``dpvision tune``, the private selection, over
  :mod:`dpvision.runs.search` (the candidates and K's distribution) and
  :mod:`dpvision.runs.selection_plan` (its calibration);
* :mod:`dpvision.runs.saved` — a trained model in one file (``--save``), loaded again for
  ``dpvision predict`` and ``evaluate``.
"""
