"""An Opacus-style API for your own model and training loop: ``PrivacyEngine.make_private``.

>>> import torch
>>> from torch import nn
>>> from torch.utils.data import DataLoader, TensorDataset
>>> from dpvision import PrivacyEngine
>>> data = TensorDataset(torch.randn(100, 4), torch.randint(0, 3, (100,)))
>>> engine = PrivacyEngine(accountant="pld")
>>> model = nn.Linear(4, 3)
>>> model, optimizer, loader = engine.make_private(
...     module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
...     data_loader=DataLoader(data, batch_size=10), noise_multiplier=1.1, max_grad_norm=1.0)
>>> for x, y in loader:
...     optimizer.zero_grad()
...     nn.functional.cross_entropy(model(x), y).backward()  # a plain mean: verified
...     optimizer.step()
>>> engine.ledger.total_count  # one Poisson-sampled Gaussian step per logical batch
10
>>> round(engine.get_epsilon(delta=1e-5), 2)
2.35

What happens, in Opacus' terms:

* the **module** is wrapped (:class:`PrivateModule`); forward hooks on its layers record
  the activations and, during ``loss.backward()``, the gradients of the layer outputs (the
  book-keeping of :mod:`dpvision.per_example.bookkeeping`, shared with the DP-SGD engine);
* the **data loader** (:class:`DPDataLoader`) draws Poisson batches of the dataset at rate
  q = batch_size/N, ⌈1/q⌉ of them per epoch, *empty batches included* (as zero-length
  tensors); it can split each batch into physical chunks and make K augmented views of
  each example;
* the **optimizer** (:class:`DPOptimizer`) turns the recorded quantities into per-example
  gradient norms, clips each example's gradient (the mean of its K view-gradients) to C,
  sums, and at the end of each logical batch adds N(0, (σC)²) **once**, divides by the
  public qN, steps the wrapped optimizer, records the step in the engine's
  :class:`~dpvision.accounting.PrivacyLedger` and updates the parameter EMA;
  ``optimizer.ema_model()`` is a copy of the module with the averaged parameters;
* the noise and the Poisson sampling draw from **secret randomness**
  (:mod:`dpvision.mechanisms.secret`): fresh OS entropy at every ``make_private``, or
  ``secret_seed=`` to replay a research run; ``seed=`` seeds only the augmentation, which
  the adversary may know (a ``noise_generator`` you pass is used as given, and its seed is
  then yours to keep secret);
* a recorded forward pass that writes one of the module's buffers (BatchNorm's running
  statistics, an activation observer) is refused: the buffer would hold an exact statistic
  of the private batch;
* in evaluation mode (``model.eval()``) or under ``torch.no_grad()`` the private module is
  the plain module: any batch size, nothing recorded.

Opacus code runs with only the import changed: ``PrivacyEngine(secure_mode=False)``,
``make_private(..., clipping="flat", grad_sample_mode=...)`` (any of Opacus' modes; with
``"ghost"`` the criterion is returned too), ``engine.accountant.get_epsilon(delta)``,
``accountant.history`` and ``state_dict()``/``load_state_dict()``,
``engine.save_checkpoint``/``load_checkpoint`` (module, optimizer, accountant; no secret
randomness in the file, :mod:`dpvision.privacy_engine.checkpoint`),
``model.disable_hooks()``/``enable_hooks()`` (a step while they are off is refused),
:class:`BatchMemoryManager` and :class:`ModuleValidator`. Opacus' sample rate is
1/len(data_loader) = 1/⌈N/B⌉; dpvision's is B/N (the same when B divides N; B/N is the
rate at which each example is in a batch of expected size B). Where dpvision deliberately
differs it refuses in one line: only Poisson sampling (the accountant assumes it), flat
clipping, examples first in every layer. Every standard layer is supported (see
:mod:`dpvision.per_example.layers`); BatchNorm only with frozen statistics. What cannot be
clipped per example is refused with a one-line :class:`~dpvision.errors.DPVisionError`,
never clipped per row: a layer whose rows are not the examples (folded positions, a
sequence-first input, examples mixed before it), two forward passes before one step (unless
inside :meth:`PrivateModule.same_examples`), or a parameter used outside its layer's
``forward``.
A loop that leaves a logical batch after a non-final chunk has that chunk's clipped sum
discarded, never released with the next batch.

What it takes on trust, Opacus takes too; dpvision verifies it instead:

* **the loss** (:mod:`dpvision.privacy_engine.loss`): the gradient at the model's output
  must be that of a plain mean (or sum) of cross-entropy or NLL, recognised row by row and
  recomputed from each row alone, or come from ``model.per_example_loss(criterion)``; class
  weights, ``ignore_index``, label smoothing, a scaled loss or a term across the batch are
  refused at ``loss.backward()``;
* **mixing at every step**: each recorded pass is run again without gradients from its own
  random state with one example changed, and refused if another example's output moves
  (a tenth to a fifth of a step on the CPU);
* **the batches**: ``optimizer.step()`` must follow a chunk the private data loader
  yielded, over its rows, its inputs (each row's size within a cast of the loader's) and
  its labels; a skipped batch, a step with nothing recorded (evaluation mode) and a batch
  of the loop's own are refused, the last unless ``optimizer.declare_sampling(q)``
  declares how it was drawn (the ledger records q);
* **precision**: the norms and the clipped sum are computed in IEEE float32 whatever the
  TF32 and autocast settings (:mod:`dpvision.per_example.precision`).
"""

from dpvision.privacy_engine.batch_memory_manager import BatchMemoryManager
from dpvision.privacy_engine.data_loader import DPDataLoader
from dpvision.privacy_engine.engine import LedgerAccountant, PrivacyEngine
from dpvision.privacy_engine.module import PrivateModule
from dpvision.privacy_engine.optimizer import DPOptimizer
from dpvision.privacy_engine.validator import ModuleValidator

__all__ = [
    "BatchMemoryManager",
    "DPDataLoader",
    "DPOptimizer",
    "LedgerAccountant",
    "ModuleValidator",
    "PrivacyEngine",
    "PrivateModule",
]
