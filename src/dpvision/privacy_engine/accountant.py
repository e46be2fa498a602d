"""``privacy_engine.accountant``: what Opacus code reads as the engine's accountant, over
the engine's ledger.

Privacy:
  Reads and restores the public accounting (the ledger of noisy releases); touches no data.
"""

from collections import OrderedDict
from typing import Any

from dpvision.accounting import LedgerEntry, PrivacyLedger
from dpvision.accounting.accountants import Accountant
from dpvision.errors import DPVisionError


class LedgerAccountant:
    """What Opacus code reads as ``privacy_engine.accountant``: ε of the engine's ledger.

    Unlike Opacus' accountants it keeps no history of its own: the ledger of the steps that
    ran is the only input, so ``get_epsilon`` can never disagree with ``engine.ledger``;
    :attr:`history` is the ledger in Opacus' form.
    """

    def __init__(self, kind: Accountant, ledger: PrivacyLedger) -> None:
        self.kind, self.ledger = kind, ledger

    def get_epsilon(self, delta: float, **_: object) -> float:
        """ε at ``delta`` (Opacus' extra keywords, e.g. ``eps_error``, are accepted and
        ignored: the accountant's own tolerance applies)."""
        return self.ledger.epsilon(delta, accountant=self.kind)

    def mechanism(self) -> str:
        """The accountant's name (``pld``, ``rdp`` or ``classic-rdp``), as Opacus'."""
        return str(self.kind.value)

    def __len__(self) -> int:
        """The number of noisy steps accounted (Opacus: the length of the history)."""
        return int(self.ledger.total_count)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """Opacus' ``accountant.history``: ``(noise_multiplier, sample_rate, num_steps)``
        for each run of consecutive steps with the same σ and q, in order (read-only: a
        view of the ledger, which records the steps)."""
        out: list[tuple[float, float, int]] = []
        for entry in self.ledger:
            if not isinstance(entry, LedgerEntry):  # only tune records selections
                raise DPVisionError(f"{entry.released!r} has no (σ, q, steps) form")
            if out and out[-1][:2] == (entry.noise_multiplier, entry.sample_rate):
                out[-1] = (*out[-1][:2], out[-1][2] + entry.count)
            else:
                out.append((entry.noise_multiplier, entry.sample_rate, entry.count))
        return out

    def state_dict(self) -> "OrderedDict[str, Any]":
        """Opacus' accountant ``state_dict``: ``history`` and ``mechanism``, plus the
        ``ledger`` itself (what each step released and its sensitivity)."""
        return OrderedDict(
            history=self.history, mechanism=self.mechanism(), ledger=self.ledger.to_dict()
        )

    def check_fresh(self) -> None:
        """Refuses to load over steps already accounted: they would drop out of ε."""
        if len(self.ledger):
            raise DPVisionError(
                f"this engine has already accounted {self.ledger.total_count} steps, which "
                "loading a state would drop from ε: load the checkpoint into a new "
                "PrivacyEngine before training"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Opacus' ``load_state_dict``: the steps of a :meth:`state_dict` (or of an Opacus
        accountant's, from its ``history``) become this engine's ledger, so ε continues
        from them. Any accountant's state loads (the steps are the same for all); into an
        engine that already accounted steps it is refused."""
        self.check_fresh()
        if not isinstance(state_dict, dict) or "history" not in state_dict:
            raise DPVisionError("not an accountant state_dict: it has no 'history'")
        if "ledger" in state_dict:
            loaded = PrivacyLedger.from_dict(state_dict["ledger"])
        else:  # an Opacus accountant's: (σ, q, steps) triples
            loaded = PrivacyLedger()
            try:
                for sigma, rate, steps in state_dict["history"]:
                    loaded.record(
                        noise_multiplier=sigma,
                        sample_rate=rate,
                        count=steps,
                        released="DP-SGD gradient sum (from an accountant's history)",
                    )
            except (TypeError, ValueError) as error:
                raise DPVisionError(f"malformed accountant history: {error}") from None
        self.ledger.extend(loaded)
