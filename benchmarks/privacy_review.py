"""The privacy review's three reproductions (issue 35), runnable on any dpvision version.

1. **Replay**: an adversary who knows D without the target reruns the published config
   (seed included) and says "the target is out" when the rerun equals the published model.
   Reports TPR and FPR over ``--trials`` targets in and out (DP at ε = 1 allows
   TPR ≤ e·FPR + δ).
2. **Splits**: how many *other* rows change sides (training ↔ held out) when one example is
   added, for the validation split (f = 0.1) and the public split (f = 0.1); and the largest
   release movement / sensitivity of dp-ls end to end (noise off, validation_fraction 0.1),
   one example appended.
3. **Tune**: which keys of the tune result say how many runs there were or which ran.

    python benchmarks/privacy_review.py                       # this checkout
    PYTHONPATH=/old/checkout/src python benchmarks/privacy_review.py --label "old main"

Writes a Markdown table to stdout (benchmarks/results/privacy_review.md has both runs).
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

import dpvision
from dpvision.testing import check_sensitivity


def _digits(n: int) -> tuple[np.ndarray, np.ndarray]:
    digits = load_digits()
    return (digits.images * 15).astype(np.uint8)[:n, ..., None], digits.target[:n].astype(np.int64)


def _write(path: Path, images: np.ndarray, labels: np.ndarray) -> str:
    test_x, test_y = _digits(1797)
    np.savez(path, x_train=images, y_train=labels, x_test=test_x[-200:], y_test=test_y[-200:])
    return f"npz:{path}"


def _weights(model: object) -> np.ndarray:
    return np.concatenate([np.ravel(model.coef), np.ravel(model.intercept)])  # type: ignore[attr-defined]


def replay(method: str, trials: int, folder: Path) -> tuple[float, float]:
    """(TPR, FPR) of the replay attack on ``method`` at ε = 1."""
    images, labels = _digits(300)
    extra = {"learner": {"epochs": 2}} if method == "dp-sgd-linear" else {}
    said_in = {True: 0, False: 0}
    for trial in range(trials):
        for member in (True, False):
            rows = np.arange(300) if member else np.delete(np.arange(300), trial)
            published = dpvision.train(
                dataset=_write(folder / "d.npz", images[rows], labels[rows]),
                method=method,
                features="pixels",
                epsilon=1.0,
                num_classes=10,
                **extra,
            )
            config = published.result["config"]
            without = np.delete(np.arange(300), trial)
            rerun = dpvision.train(
                dataset=_write(folder / "r.npz", images[without], labels[without]),
                method=config["method"],
                features=config["features"],
                epsilon=config["epsilon"],
                seed=config["seed"],
                num_classes=10,
                learner=config["learner"],
            )
            equal = np.array_equal(_weights(rerun.model), _weights(published.model))
            said_in[member] += not equal
    return said_in[True] / trials, said_in[False] / trials


def moved_rows(n: int, which: str) -> int:
    """Other rows that change sides when one example is appended (f = 0.1)."""
    rng = np.random.default_rng(n)
    images = rng.integers(0, 256, (n + 1, 4, 4, 1), dtype=np.uint8)
    labels = rng.integers(0, 10, n + 1)
    try:  # after issue 35: a keyed hash of each example
        from dpvision.data import splits

        key = b"k" * 32

        def held(count: int) -> set[int]:
            if which == "public":
                return set(splits.public_split(images[:count], labels[:count], 0.1)[1].tolist())
            return set(
                splits.validation_split(images[:count], labels[:count], 0.1, key)[1].tolist()
            )

    except ImportError:  # before: seeded permutations of range(n)
        from dpvision.data.public import public_split
        from dpvision.data.validation import validation_split

        def held(count: int) -> set[int]:
            if which == "public":
                return set(public_split(count, 0.1)[1].tolist())
            return set(validation_split(count, 0.1, seed=0)[1].tolist())

    before, after = held(n), held(n + 1) - {n}
    return len(before ^ after)


def end_to_end_ratio(folder: Path) -> float:
    """dp-ls, noise off, validation_fraction 0.1: the largest release movement over its
    sensitivity when one example is appended."""
    images, labels = _digits(400)
    fixed = {"secret_seed": 1} if _has_secret() else {}  # the same split on D and D′

    def run(data: tuple[np.ndarray, np.ndarray]) -> None:
        dataset = _write(folder / "e.npz", *data)  # one path: it keys the secret too
        dpvision.train(
            dataset=dataset,
            method="dp-ls",
            features="pixels",
            noise_multiplier=0.0,
            validation_fraction=0.1,
            num_classes=10,
            **fixed,
        )

    def outlier(
        data: tuple[np.ndarray, np.ndarray], rng: np.random.Generator
    ) -> tuple[np.ndarray, int]:
        return rng.integers(0, 256, data[0].shape[1:], dtype=np.uint8), int(data[1][0])

    report = check_sensitivity(run, (images, labels), positions=[400, 0, 200], outlier=outlier)
    return report.max_ratio


def _has_secret() -> bool:
    from dpvision.config import TrainConfig

    return "secret_seed" in TrainConfig.__dataclass_fields__


def tune_keys() -> list[str]:
    result, _ = dpvision.tune(
        ["learner.learning_rate=0.1,0.5"], dataset="digits", epsilon=3.0, learner={"epochs": 2}
    )
    tuning = result.get("tuning", {})
    leaks = [f"tuning.{k}" for k in ("runs", "drawn", "tuning_seconds") if k in tuning]
    return leaks + [k for k in ("wall_seconds",) if k in result]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print(f"## {args.label}\n")
        print("| reproduction | measured |\n|---|---|")
        for method in ("dp-ls", "dp-sgd-linear"):
            tpr, fpr = replay(method, args.trials, folder)
            what = f"replay attack on {method}, ε = 1 ({args.trials} targets in, {args.trials} out)"
            print(f"| {what} | TPR {tpr:.2f}, FPR {fpr:.2f} |")
        for n in (1000, 60_000):
            for which in ("validation", "public"):
                what = f"{which} split, n = {n}, f = 0.1: other rows moved by one example"
                print(f"| {what} | {moved_rows(n, which)} |")
        what = "dp-ls end to end, validation_fraction 0.1: max movement / sensitivity"
        print(f"| {what} | {end_to_end_ratio(folder):.3f} |")
        what = "tune result fields that reveal K, draws or timing"
        print(f"| {what} | {', '.join(tune_keys()) or 'none'} |")


if __name__ == "__main__":
    main()
