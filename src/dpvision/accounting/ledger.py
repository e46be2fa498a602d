"""The privacy ledger: an ordered record of the mechanisms a run actually executed.

Every noisy release appends an entry (or increments the count of the previous entry when
the release repeats with identical parameters, as DP-SGD steps do). The ledger is the only
input to the ε a run reports: it is turned into a ``dp_accounting`` DpEvent and handed to an
accountant, so what is reported is what ran. It serialises to JSON for result files and
checkpoints, and is restored from that JSON on resume.

Adjacency is add/remove-one example throughout.
"""

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from dpvision.accounting._checks import (
    check_delta,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
)
from dpvision.accounting.accountants import (
    RDP_ORDERS,
    Accountant,
    compute_epsilon,
    parse_accountant,
)
from dpvision.accounting.events import compose_events, gaussian_event, poisson_gaussian_event
from dpvision.accounting.selection import (
    Repetitions,
    rdp_curve,
    repeat_and_select_event,
    selection_rdp,
)
from dpvision.errors import DPVisionError

LEDGER_FORMAT = "dpvision-ledger/1"
NON_PRIVATE = "none"
SELECTION = "repeat-and-select"
NOISE_SOURCES = ("pseudo-random", "secure")
NEIGHBORING_RELATION = "add_or_remove_one"


@dataclass(frozen=True)
class LedgerEntry:
    """One kind of release, repeated ``count`` times.

    Attributes:
      mechanism: ``"gaussian"`` (Gaussian noise on a clipped sum), or ``"none"`` for a release
        made without noise (a non-private baseline): its ε is infinite.
      noise_multiplier: σ, the noise std divided by the L2 sensitivity.
      sample_rate: q, the Poisson sampling rate of each release; 1.0 = full batch.
      count: How many times the release ran.
      released: What was released, in words (e.g. ``"DP-SGD gradient sum"``).
      l2_sensitivity: The L2 sensitivity Δ the noise was scaled to (noise std σΔ), when known.
      noise_source: ``"pseudo-random"`` (a seeded generator) or ``"secure"`` (the operating
        system's CSPRNG, :mod:`dpvision.mechanisms.secure`); written to JSON only when secure.
    """

    noise_multiplier: float
    sample_rate: float
    count: int
    released: str
    l2_sensitivity: float | None = None
    mechanism: str = "gaussian"
    noise_source: str = "pseudo-random"

    def __post_init__(self) -> None:
        check_sample_rate(self.sample_rate)
        check_steps(self.count, "count")
        if self.mechanism == NON_PRIVATE:
            if self.noise_multiplier != 0:
                raise DPVisionError("a non-private ledger entry must have noise_multiplier 0")
        elif self.mechanism == "gaussian":
            check_noise_multiplier(self.noise_multiplier)
        else:
            raise DPVisionError(f"unknown mechanism {self.mechanism!r} in ledger entry")
        if self.noise_source not in NOISE_SOURCES:
            raise DPVisionError(f"unknown noise_source {self.noise_source!r} in ledger entry")
        if self.l2_sensitivity is not None and not (
            math.isfinite(self.l2_sensitivity) and self.l2_sensitivity > 0
        ):
            raise DPVisionError(f"l2_sensitivity must be finite and > 0, got {self.l2_sensitivity}")

    @property
    def sampling(self) -> str:
        """``"poisson"`` for sampled releases, ``"none"`` for full batch."""
        return "none" if self.sample_rate == 1.0 else "poisson"

    def dp_event(self) -> dp_accounting.DpEvent:
        """The DpEvent of this entry's ``count`` releases."""
        if self.mechanism == NON_PRIVATE:
            return dp_accounting.NonPrivateDpEvent()
        if self.sample_rate == 1.0:
            return gaussian_event(noise_multiplier=self.noise_multiplier, count=self.count)
        return poisson_gaussian_event(
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate,
            steps=self.count,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, with the derived ``sampling`` field for readers."""
        fields = asdict(self)
        if self.noise_source == "pseudo-random":
            del fields["noise_source"]
        return {**fields, "sampling": self.sampling}


@dataclass(frozen=True)
class SelectionEntry:
    """A private selection (:mod:`dpvision.accounting.selection`): K runs of a mechanism Q,
    K drawn from ``Repetitions(mean, shape)``, only the best run released.

    Each run of Q draws one candidate, independently of the data, and makes that
    candidate's releases (``candidates[i]``: its training and its noisy score, as ledger
    entries). Accounted with RDP: the candidates' pointwise-maximum RDP curve, then
    Papernot & Steinke's bound (:func:`~dpvision.accounting.selection.selection_rdp`).

    Attributes:
      candidates: every candidate's releases, whether or not it was drawn.
      mean, shape: the distribution of K (:class:`~dpvision.accounting.Repetitions`).
      released: what was released, in words.
      count: how many such selections ran (1).
    """

    candidates: tuple[tuple[LedgerEntry, ...], ...]
    mean: float
    shape: float
    released: str
    count: int = 1
    mechanism: str = SELECTION

    def __post_init__(self) -> None:
        check_steps(self.count, "count")
        if self.mechanism != SELECTION:
            raise DPVisionError(f"a selection entry has mechanism {SELECTION!r}")
        if not self.candidates or not all(self.candidates):
            raise DPVisionError("a selection entry needs candidates, each with its releases")
        for releases in self.candidates:
            for entry in releases:
                if not isinstance(entry, LedgerEntry) or entry.mechanism != "gaussian":
                    raise DPVisionError("a selection's candidates make Gaussian releases only")
        self.repetitions  # noqa: B018 (checks mean and shape)

    @property
    def repetitions(self) -> Repetitions:
        return Repetitions(float(self.mean), float(self.shape))

    def candidate_events(self) -> list[dp_accounting.DpEvent]:
        """One composed DpEvent per candidate: Q's mechanism when it draws that candidate."""
        return [compose_events([e.dp_event() for e in releases]) for releases in self.candidates]

    def rdp(self, orders: tuple[float, ...] = RDP_ORDERS) -> np.ndarray:
        """The RDP of the ``count`` selections at ``orders``."""
        return self.count * selection_rdp(self.candidate_events(), self.repetitions, orders)

    def dp_event(self) -> dp_accounting.DpEvent:
        """dp-accounting's ``RepeatAndSelectDpEvent`` when every candidate makes the same
        releases; a selection among different releases (a mixture) has no DpEvent:
        :meth:`PrivacyLedger.epsilon` accounts it from :meth:`rdp`."""
        events = self.candidate_events()
        if any(event != events[0] for event in events):
            raise DPVisionError(
                "a selection among candidates with different releases is a mixture, which "
                "no single DpEvent describes; use the ledger's epsilon (RDP)"
            )
        selection = repeat_and_select_event(events[0], self.repetitions)
        return (
            selection
            if self.count == 1
            else dp_accounting.SelfComposedDpEvent(selection, self.count)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "mechanism": self.mechanism,
            "released": self.released,
            "count": self.count,
            "mean": self.mean,
            "shape": self.shape if math.isfinite(self.shape) else "inf",
            "candidates": [[e.to_dict() for e in releases] for releases in self.candidates],
        }


_ENTRY_FIELDS = {
    "noise_multiplier",
    "sample_rate",
    "count",
    "released",
    "l2_sensitivity",
    "mechanism",
    "noise_source",
}


def _entry_from_dict(raw: Any) -> "LedgerEntry | SelectionEntry":
    if not isinstance(raw, dict):
        raise DPVisionError("malformed privacy ledger entry: expected an object")
    try:
        if raw.get("mechanism") == SELECTION:
            candidates = raw.get("candidates")
            if not isinstance(candidates, list) or not all(isinstance(c, list) for c in candidates):
                raise DPVisionError("malformed privacy ledger entry: candidates must be lists")
            return SelectionEntry(
                candidates=tuple(
                    tuple(_gaussian_entry(entry) for entry in releases) for releases in candidates
                ),
                mean=float(raw["mean"]),
                shape=float(raw["shape"]),
                released=str(raw["released"]),
                count=raw.get("count", 1),
            )
        return LedgerEntry(**{k: v for k, v in raw.items() if k in _ENTRY_FIELDS})
    except (TypeError, KeyError, ValueError) as error:
        raise DPVisionError(f"malformed privacy ledger entry: {error}") from None


def _gaussian_entry(raw: Any) -> LedgerEntry:
    entry = _entry_from_dict(raw)
    if not isinstance(entry, LedgerEntry):
        raise DPVisionError("malformed privacy ledger entry: a selection inside a selection")
    return entry


class PrivacyLedger:
    """An ordered, append-only record of the Gaussian releases a run made.

    Examples:
      >>> ledger = PrivacyLedger()
      >>> ledger.record(noise_multiplier=8.0, released="mean of clipped features")
      >>> for _ in range(500):
      ...     ledger.record(noise_multiplier=1.1, sample_rate=0.01, released="DP-SGD gradient sum")
      >>> [(e.released, e.count) for e in ledger]
      [('mean of clipped features', 1), ('DP-SGD gradient sum', 500)]
      >>> PrivacyLedger.from_json(ledger.to_json()) == ledger
      True
    """

    def __init__(self, entries: "Iterable[LedgerEntry | SelectionEntry]" = ()) -> None:
        self._entries: list[LedgerEntry | SelectionEntry] = []
        for entry in entries:
            self._append(entry)

    def _append(self, entry: "LedgerEntry | SelectionEntry") -> None:
        last = self._entries[-1] if self._entries else None
        if last is not None and replace(last, count=entry.count) == entry:
            self._entries[-1] = replace(last, count=last.count + entry.count)
        else:
            self._entries.append(entry)

    def record(
        self,
        *,
        noise_multiplier: float,
        released: str,
        sample_rate: float = 1.0,
        count: int = 1,
        l2_sensitivity: float | None = None,
        noise_source: str = "pseudo-random",
    ) -> None:
        """Appends ``count`` releases of Gaussian noise with multiplier σ at sampling rate q
        (``noise_source``: see :class:`LedgerEntry`)."""
        self._append(
            LedgerEntry(
                noise_multiplier=float(noise_multiplier),
                sample_rate=float(sample_rate),
                count=int(count),
                released=released,
                l2_sensitivity=None if l2_sensitivity is None else float(l2_sensitivity),
                noise_source=noise_source,
            )
        )

    def record_non_private(self, *, released: str, count: int = 1) -> None:
        """Records a release made *without* noise; the ledger's ε becomes infinite."""
        self._append(
            LedgerEntry(
                noise_multiplier=0.0,
                sample_rate=1.0,
                count=int(count),
                released=released,
                mechanism=NON_PRIVATE,
            )
        )

    @property
    def is_private(self) -> bool:
        """False once anything was released without noise."""
        return all(entry.mechanism != NON_PRIVATE for entry in self._entries)

    def extend(self, other: "PrivacyLedger") -> None:
        """Appends every entry of ``other`` (e.g. a later training phase), in order."""
        for entry in other:
            self._append(entry)

    @property
    def entries(self) -> "tuple[LedgerEntry | SelectionEntry, ...]":
        return tuple(self._entries)

    def __iter__(self) -> "Iterator[LedgerEntry | SelectionEntry]":
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrivacyLedger) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"PrivacyLedger({self._entries!r})"

    @property
    def total_count(self) -> int:
        """The number of noisy releases recorded, over all entries."""
        return sum(entry.count for entry in self._entries)

    def dp_event(self) -> dp_accounting.DpEvent:
        """The composed DpEvent of everything recorded (``NoOpDpEvent`` when empty)."""
        return compose_events([entry.dp_event() for entry in self._entries])

    def epsilon(self, delta: float, accountant: "Accountant | str | None" = None) -> float:
        """ε of the whole record at ``delta`` (the tightest valid accountant by default).

        A record with a private selection is accounted with RDP (the only accountant with a
        rule for it): the sum of every entry's RDP curve, converted by dp-accounting.
        """
        if not any(isinstance(entry, SelectionEntry) for entry in self._entries):
            return compute_epsilon(self.dp_event(), delta=delta, accountant=accountant)
        if accountant is not None and parse_accountant(accountant) is not Accountant.RDP:
            raise DPVisionError(
                f"the {parse_accountant(accountant)} accountant cannot account for a private "
                "selection; use rdp"
            )
        curve = sum(
            (
                entry.rdp()
                if isinstance(entry, SelectionEntry)
                else rdp_curve(entry.dp_event(), RDP_ORDERS)
            )
            for entry in self._entries
        )
        epsilon, _ = rdp.compute_epsilon(list(RDP_ORDERS), curve, check_delta(delta))
        return max(0.0, float(epsilon))

    def record_selection(self, entry: SelectionEntry) -> None:
        """Appends a private selection (its candidates' releases inside it)."""
        if not isinstance(entry, SelectionEntry):
            raise DPVisionError("record_selection takes a SelectionEntry")
        self._append(entry)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT,
            "neighboring_relation": NEIGHBORING_RELATION,
            "entries": [entry.to_dict() for entry in self._entries],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyLedger":
        """Rebuilds a ledger from :meth:`to_dict` output; a malformed record is a one-line error."""
        if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT:
            raise DPVisionError(f"not a dpvision privacy ledger (expected format {LEDGER_FORMAT})")
        if data.get("neighboring_relation") != NEIGHBORING_RELATION:
            raise DPVisionError(
                f"unsupported neighboring relation {data.get('neighboring_relation')!r}"
            )
        entries = [_entry_from_dict(raw) for raw in data.get("entries", [])]
        return cls(entries)

    @classmethod
    def from_json(cls, text: str) -> "PrivacyLedger":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise DPVisionError(f"privacy ledger is not valid JSON: {error}") from None
        return cls.from_dict(data)
