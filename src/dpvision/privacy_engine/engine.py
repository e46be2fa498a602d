"""``PrivacyEngine.make_private``: the module, optimizer and data loader made private together.

The noise and the Poisson sampling, on which the guarantee rests, draw from secret
randomness (:class:`~dpvision.mechanisms.secret.SecretRandomness`): fresh OS entropy at each
``make_private`` by default, or ``secret_seed`` to replay a research run. ``seed`` seeds only
the public randomness (the augmentation): the adversary is assumed to know it, as it knows
the code and every published byte.
"""

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpvision.accounting import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    parse_accountant,
)
from dpvision.accounting.accountants import Accountant, prepare_steps
from dpvision.averaging import ParameterEMA
from dpvision.errors import DPVisionError
from dpvision.mechanisms.clip_policy import ClipPolicy, make_clip_policy
from dpvision.mechanisms.gradient_release import GradientRelease, ReleaseContext
from dpvision.mechanisms.noise import NoiseGenerator
from dpvision.mechanisms.secret import SecretRandomness
from dpvision.per_example.tape import ActivationTape
from dpvision.privacy_engine.accountant import LedgerAccountant
from dpvision.privacy_engine.checkpoint import (
    CheckpointPath,
    checkpoint_contents,
    load_module_state,
    read_checkpoint,
    refuse_schedulers,
    write_checkpoint,
)
from dpvision.privacy_engine.data_loader import (
    DPDataLoader,
    loader_sample_rate,
    private_data_loader,
)
from dpvision.privacy_engine.loss import OutputGate
from dpvision.privacy_engine.module import PrivateModule
from dpvision.privacy_engine.optimizer import DPOptimizer
from dpvision.privacy_engine.preparation import (
    augment_seed,
    check_module,
    check_options,
    prepare_criterion,
)
from dpvision.privacy_engine.secret_context import call_noise, call_secret


class PrivacyEngine:
    """Makes a model, its optimizer and its data loader differentially private (DP-SGD).

    Args:
      accountant: the accountant that calibrates σ and reports ε: ``pld`` (default),
        ``rdp`` or ``classic-rdp``; Opacus' ``prv`` (numerical, like PLD) is taken as
        ``pld``, its ``gdp`` (an asymptotic approximation, not a bound) is refused.
      secure_mode: as Opacus' switch: the noise and the Poisson sampling draw from the
        operating system's CSPRNG at every draw (:mod:`dpvision.mechanisms.secure`; slower,
        not reproducible: no ``noise_generator`` or ``secret_seed``), and the ledger marks
        every step ``noise_source = "secure"``.

    Attributes:
      ledger: every noisy release made through this engine, the only input to ε.
      accountant: as Opacus' ``privacy_engine.accountant``: ``get_epsilon(delta)`` and
        ``mechanism()`` (the ledger is what it accounts).
    """

    def __init__(self, accountant: str = "pld", secure_mode: bool = False) -> None:
        self.secure_mode = bool(secure_mode)
        if accountant == "gdp":
            raise DPVisionError(
                "the gdp accountant (a central-limit approximation) is not offered: its ε is "
                "not an upper bound; use pld (Opacus' prv) or rdp"
            )
        kind = parse_accountant("pld" if accountant == "prv" else accountant)
        if kind is Accountant.GAUSSIAN:
            raise DPVisionError("the gaussian accountant cannot account for Poisson sampling")
        self.ledger = PrivacyLedger()
        self.accountant = LedgerAccountant(kind, self.ledger)
        self.optimizer: DPOptimizer | None = None
        self._made = 0  # make_private calls: each gets its own secret streams
        # Whether a make_private used secret_seed / a checkpoint was loaded: together they
        # would replay the first steps' noise on the resumed steps (load_checkpoint).
        self._replayable = self._resumed = False
        # Whether σ was calibrated to a target ε: steps loaded afterwards would overshoot it.
        self._calibrated = False

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader[Any],
        noise_multiplier: float,
        max_grad_norm: float | list[float],
        poisson_sampling: bool = True,
        augmult: int = 0,
        ema_decay: float | None = None,
        normalize_update: bool = False,
        loss_reduction: str = "mean",
        max_physical_batch_size: int | None = None,
        noise_generator: torch.Generator | None = None,
        seed: int | None = None,
        secret_seed: int | None = None,
        clipping: str = "flat",
        grad_sample_mode: str = "hooks",
        criterion: nn.Module | None = None,
        batch_first: bool = True,
        target_unclipped_quantile: float = 0.5,
        clipbound_learning_rate: float = 0.2,
        max_clipbound: float = 1e6,
        min_clipbound: float = 1e-6,
        unclipped_num_std: float | None = None,
    ) -> (
        tuple[PrivateModule, DPOptimizer, DPDataLoader]
        | tuple[PrivateModule, DPOptimizer, nn.Module, DPDataLoader]
    ):
        """Returns the private (module, optimizer, data loader) triple.

        Opacus' ``make_private`` calls run unchanged: ``clipping="flat"`` (each example's
        whole gradient clipped to C) or ``"per_layer"``, any ``grad_sample_mode`` of Opacus
        (``hooks``, ``functorch``, ``ew``, ``ghost``: all give the same exact clipped sum
        here, by book-keeping with a rule per layer kind) and, for ``ghost``, the
        ``criterion`` comes back as the third of four values, as in Opacus.

        Args:
          module: the model; any standard layer (see :mod:`dpvision.per_example.layers`),
            BatchNorm only with frozen statistics.
          optimizer: any torch optimizer over (some of) ``module``'s parameters.
          data_loader: a ``DataLoader`` with a ``batch_size``; q = batch_size/len(dataset).
          noise_multiplier: σ ≥ 0.
          max_grad_norm: C > 0; with ``clipping="per_layer"`` also one norm per layer
            with trainable parameters (a number C gives each of the G layers C/√G).
          poisson_sampling: must be True (fixed-size shuffled batches are not offered: the
            accountant assumes Poisson sampling).
          augmult: K augmented views (random crop after 4-pixel reflect padding, horizontal
            flip) per example; 0 for none.
          ema_decay: decay of a parameter EMA (``optimizer.ema``), or None.
          normalize_update: divide the noisy sum by C as well.
          loss_reduction: how the loss reduces over a batch's rows: ``mean`` or ``sum``.
          max_physical_batch_size: split each logical batch into chunks of at most this many
            examples (memory only: noise is still added once per logical batch).
          noise_generator: the noise's source, as in Opacus (None, the default: a generator
            seeded from the secret randomness). A generator passed here is used as given and
            is then the caller's responsibility: seeded with a number the adversary knows
            or can guess (a published seed, 0), its noise can be replayed and subtracted.
          seed: seeds the public randomness only, the augmentation (None: fresh entropy);
            never the noise or the sampling, since the adversary may know it.
          secret_seed: seeds the noise and the Poisson sampling, to replay a research run
            (None, the default: 256 bits of fresh OS entropy at every call). It is never
            stored or shown; a guessable one (0, 1, ...) protects nothing. Refused with
            ``secure_mode``. Two calls on one engine draw independent streams.
          clipping: ``flat``, or ``per_layer`` (:mod:`dpvision.mechanisms.groups`: the
            part of each example's gradient in layer g is clipped to C_g; sensitivity and
            noise scale √(Σ C_g²)). Unlike Opacus, a layer's weight and bias are one group.
            Or ``adaptive`` (:mod:`dpvision.mechanisms.adaptive_clipping`): C starts at
            ``max_grad_norm`` and follows the ``target_unclipped_quantile`` of the
            per-example norms (steps of ``clipbound_learning_rate``, within
            [``min_clipbound``, ``max_clipbound``]), from a count released each step with
            noise ``unclipped_num_std`` (default: the expected batch size over 20); σ is
            split between the sum and the count, so each step stays one release of σ.
          target_unclipped_quantile: adaptive clipping's γ (Opacus' names from here on;
            defaults: :data:`~dpvision.mechanisms.clip_policy.ADAPTIVE_DEFAULTS`).
          clipbound_learning_rate: adaptive clipping's η.
          max_clipbound: the upper bound on C.
          min_clipbound: the lower bound on C.
          unclipped_num_std: σ_b of the unclipped count (None: the expected batch over 20).
          grad_sample_mode: accepted for Opacus code; the clipping is the same for all.
            (``dpvision train`` takes the same two names: ``learner.clipping``, the clip
            policy above, and ``learner.grad_sample_mode``, dpvision's own ``auto``,
            ``bookkeeping`` or ``vmap``.)
          criterion: the loss; with ``grad_sample_mode="ghost"`` it comes back wrapped as
            a :class:`~dpvision.privacy_engine.loss.PerExampleLoss` (as Opacus'
            ``DPLossFastGradientClipping``): evaluated one example at a time, so class
            weights and ``ignore_index`` are exact (default ``nn.CrossEntropyLoss()``). Its
            ``reduction`` must be ``loss_reduction`` or ``"none"``. In the other modes use
            ``model.per_example_loss(criterion)`` for a loss that is not a plain mean (or
            sum) of cross-entropy or NLL: every other loss is refused at
            ``loss.backward()`` (:mod:`dpvision.privacy_engine.loss`).
          batch_first: must be True: the examples are the first dimension of every layer's
            input (Opacus' ``batch_first=False`` is refused).

        Raises:
          DPVisionError: BatchNorm in training mode or another layer a rule refuses, a bad
            argument, an option Opacus has and dpvision deliberately lacks, an optimizer
            with parameters that are not ``module``'s, or ``secret_seed`` with
            ``secure_mode``.

        Privacy:
          Each logical step releases the noisy clipped sum of one Poisson batch (see
          :class:`DPOptimizer`) and records it in :attr:`ledger`. The guarantee holds
          against an adversary who knows the code, the arguments (``seed`` included) and
          every release: the noise and the batches come from secret randomness (the OS, a
          secret ``secret_seed``, or the CSPRNG in ``secure_mode``), never from ``seed``.
          A forward pass that writes a buffer of ``module`` is refused
          (:class:`PrivateModule`).
        """
        # With a secret_seed, the streams are keyed by everything this call is: its
        # arguments, the optimizer, the initial parameters, the rows (secret_context).
        arguments = dict(locals())
        check_options(
            clipping=clipping,
            grad_sample_mode=grad_sample_mode,
            batch_first=batch_first,
            poisson_sampling=poisson_sampling,
            noise_multiplier=noise_multiplier,
            loss_reduction=loss_reduction,
            augmult=augmult,
            ema_decay=ema_decay,
            max_physical_batch_size=max_physical_batch_size,
        )
        criterion = prepare_criterion(criterion, loss_reduction)
        check_module(module, optimizer)
        sample_rate, num_examples = loader_sample_rate(data_loader)
        release = GradientRelease(
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            expected_batch_size=sample_rate * num_examples,
            normalize_update=normalize_update,
        )
        policy = make_clip_policy(
            clipping,
            max_grad_norm,
            expected_batch_size=release.expected_batch_size,
            model=module,
            target_unclipped_quantile=target_unclipped_quantile,
            clipbound_learning_rate=clipbound_learning_rate,
            unclipped_num_std=unclipped_num_std,
            min_clipbound=min_clipbound,
            max_clipbound=max_clipbound,
        )
        sigma = policy.noise_multiplier(noise_multiplier)  # one it cannot split: refused now
        prepare_steps(sigma, sample_rate, self.accountant.kind)  # the first get_epsilon's work
        secret, call = self._prepare_secret(noise_generator, secret_seed, arguments)
        views = max(augmult, 1)
        dp_optimizer = self._prepare_optimizer(
            optimizer,
            module,
            release,
            policy,
            call_noise(noise_generator, secret, call, module),
            ema_decay=ema_decay,
            views=views,
            loss_reduction=loss_reduction,
        )
        private_loader = self._prepare_loader(
            data_loader,
            dp_optimizer,
            secret.coin_key(f"sampler {call}"),
            views=views,
            max_physical_batch_size=max_physical_batch_size,
            augment_seed=augment_seed(seed) if augmult > 0 else None,
        )
        self.optimizer = dp_optimizer
        private = PrivateModule(module, dp_optimizer.tape, views, dp_optimizer.gate)
        if grad_sample_mode == "ghost":  # Opacus' ghost mode returns the criterion too
            return private, dp_optimizer, private.per_example_loss(criterion), private_loader
        return private, dp_optimizer, private_loader

    def _prepare_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        release: GradientRelease,
        policy: ClipPolicy,
        generator: NoiseGenerator,
        *,
        ema_decay: float | None,
        views: int,
        loss_reduction: str,
    ) -> DPOptimizer:
        """The DP optimizer over ``module``, with the hooks that record its layers (attached
        now) and the gate that verifies its loss; each step recorded in :attr:`ledger`."""
        tape = ActivationTape(module, mode="hooks")
        tape.attach()
        context = ReleaseContext(
            ledger=self.ledger,
            generator=generator,
            ema=None if ema_decay is None else ParameterEMA(module, ema_decay),
        )
        return DPOptimizer(
            optimizer,
            module=module,
            tape=tape,
            release=release,
            policy=policy,
            context=context,
            views=views,
            loss_reduction=loss_reduction,
            gate=OutputGate(loss_reduction),
        )

    def _prepare_secret(
        self,
        noise_generator: torch.Generator | None,
        secret_seed: int | None,
        arguments: dict[str, Any],
    ) -> tuple[SecretRandomness, int]:
        """This call's secret randomness and its number (each call draws its own streams):
        :func:`~dpvision.privacy_engine.secret_context.call_secret` of ``make_private``'s
        ``arguments``.

        Raises:
          DPVisionError: a ``noise_generator`` or a ``secret_seed`` with ``secure_mode``.
        """
        if self.secure_mode and noise_generator is not None:
            raise DPVisionError(
                "secure_mode draws the noise from the operating system's CSPRNG: do not pass a "
                "noise_generator"
            )
        # A caller's generator or seed replays from the start on every make_private: the
        # resumed steps would draw the first steps' noise again.
        fixed = secret_seed is not None or noise_generator is not None
        if fixed and self._resumed:
            raise DPVisionError(REPLAY)
        # Secret: the noise and the sampling. Kept in no attribute; a stream per call.
        call = self._made
        secret = call_secret(secret_seed, secure=self.secure_mode, arguments=arguments, call=call)
        self._replayable = self._replayable or fixed
        self._made += 1
        return secret, call

    def _prepare_loader(
        self,
        data_loader: DataLoader[Any],
        optimizer: DPOptimizer,
        sampler_key: bytes,
        *,
        views: int,
        max_physical_batch_size: int | None,
        augment_seed: int | None,
    ) -> DPDataLoader:
        """:func:`~dpvision.privacy_engine.data_loader.private_data_loader` of
        ``data_loader``, drawing from the secret ``sampler_key`` (or the CSPRNG in secure
        mode)."""
        return private_data_loader(
            data_loader,
            optimizer,
            sampler_key,
            secure=self.secure_mode,
            views=views,
            max_physical_batch_size=max_physical_batch_size,
            augment_seed=augment_seed,
        )

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader[Any],
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float | list[float],
        **options: Any,
    ) -> (
        tuple[PrivateModule, DPOptimizer, DPDataLoader]
        | tuple[PrivateModule, DPOptimizer, nn.Module, DPDataLoader]
    ):
        """Like :meth:`make_private`, with σ calibrated to (target_epsilon, target_delta).

        σ is the smallest noise (within 0.1 %) for which ``epochs`` · ⌈1/q⌉ Poisson steps at
        rate q = batch_size/N, composed after whatever this engine's ledger already holds,
        are (ε, δ)-DP by the engine's accountant. Train exactly ``epochs`` epochs of the
        returned loader to stay within the target.

        Privacy:
          As :meth:`make_private` (``options`` as there, ``secret_seed`` and ``seed``
          included); the calibration itself uses only public quantities.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise DPVisionError(f"epochs must be a positive integer, got {epochs!r}")
        sample_rate, _ = loader_sample_rate(data_loader)
        sigma = calibrate_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            steps=epochs * math.ceil(1 / sample_rate),
            accountant=self.accountant.kind,
            preceding_event=self.ledger.dp_event() if len(self.ledger) else None,
        )
        self._calibrated = True
        return self.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=sigma,
            max_grad_norm=max_grad_norm,
            **options,
        )

    def get_epsilon(self, delta: float) -> float:
        """ε at ``delta`` of everything this engine released, by its accountant."""
        return self.accountant.get_epsilon(delta)

    def save_checkpoint(
        self,
        *,
        path: CheckpointPath,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        noise_scheduler: object = None,
        grad_clip_scheduler: object = None,
        checkpoint_dict: dict[str, Any] | None = None,
        module_state_dict_kwargs: dict[str, Any] | None = None,
        torch_save_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Opacus' ``save_checkpoint``: ``module``'s ``state_dict``, the (wrapped)
        optimizer's and the accountant's (:meth:`LedgerAccountant.state_dict`: the ledger) in
        one file at ``path``, with the entries of ``checkpoint_dict`` (an epoch counter, a
        scheduler of your own); also the EMA when the optimizer keeps one. Written
        atomically. Opacus' noise and clip schedulers do not exist here and are refused.

        Privacy:
          Releases post-processing of the noisy releases (parameters, optimizer state, EMA)
          and the public accounting: the file is as public as the model. It holds no noise
          generator, sampler state or key, so it replays no noise
          (:mod:`dpvision.privacy_engine.checkpoint`).
        """
        refuse_schedulers(noise_scheduler, grad_clip_scheduler)
        contents = checkpoint_contents(
            module,
            optimizer,
            self.accountant.state_dict(),
            checkpoint_dict,
            module_state_dict_kwargs,
        )
        write_checkpoint(path, contents, torch_save_kwargs)

    def load_checkpoint(
        self,
        *,
        path: CheckpointPath,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        noise_scheduler: object = None,
        grad_clip_scheduler: object = None,
        module_load_dict_kwargs: dict[str, Any] | None = None,
        torch_load_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Opacus' ``load_checkpoint``: restores ``module``, ``optimizer`` (and its EMA) and
        the accountant from a :meth:`save_checkpoint` file, and returns the file's dict (your
        ``checkpoint_dict`` entries included), so that ε continues from the steps it records.

        Call it on a new engine before training, after ``make_private`` (as in Opacus) or
        before it (then ``make_private_with_epsilon`` calibrates σ after the loaded steps).
        The file is read without running code (``weights_only``).

        Raises:
          DPVisionError: a missing or foreign file, a module it does not fit, an engine that
            already took steps (they would drop out of ε), or ``secret_seed``: a resumed run
            seeded like the first would draw the first steps' noise and batches again.

        Privacy:
          Reads public accounting and post-processed parameters. The resumed steps draw
          noise and batches from this engine's own secret randomness (fresh OS entropy by
          default), never from anything in the file.
        """
        refuse_schedulers(noise_scheduler, grad_clip_scheduler)
        if self._replayable:
            raise DPVisionError(REPLAY)
        if self._calibrated:
            raise DPVisionError(
                "load_checkpoint after make_private_with_epsilon: σ was calibrated without the "
                "checkpoint's steps and ε would pass the target; load the checkpoint first"
            )
        contents: dict[str, Any] = read_checkpoint(path, torch_load_kwargs)
        self.accountant.check_fresh()
        load_module_state(module, contents["module_state_dict"], module_load_dict_kwargs)
        self.accountant.load_state_dict(contents["privacy_accountant_state_dict"])
        self._resumed = True
        if optimizer is not None and contents.get("optimizer_state_dict"):
            optimizer.load_state_dict(contents["optimizer_state_dict"])
        ema = optimizer.ema if isinstance(optimizer, DPOptimizer) else None
        if ema is not None and "ema_state_dict" in contents:
            ema.load_state_dict(contents["ema_state_dict"])
        return contents


REPLAY = (
    "a checkpoint and secret_seed (or a noise_generator) together would draw the first steps' "
    "noise again for the resumed steps: resume without them (fresh OS entropy, the default)"
)
