"""Writes one config per published result of Mehta et al. (seed 000), Tables 2-4.

    python configs/seed000/make_configs.py     # rewrites configs/seed000/<dataset>/*.toml

Each table cell (fine-tuning dataset x pre-training x method x epochs x ε) becomes
``<dataset>/<features>_<method>_e<epochs>_eps<ε>.toml`` with the published accuracy in its
``[reference]`` table. The rows below are the tables as printed (non-private column first,
then ε = 0.01 ... 8; "-" is the paper's mark for an accuracy ≤ 20 %). The committed TOMLs
are this script's output; a test checks that they still are.
"""

import argparse
from pathlib import Path

EPSILONS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0)

TABLES = {
    "imagenet": """
vit-b16-i21k   DP-LS       1  75.5  71.2 71.5 71.5 73.0 73.6 74.1 74.6 75.0
vit-b16-i21k   DP-Newton   1  72.7  70.2 71.3 71.3 71.4 71.6 71.7 72.0 72.2
vit-b16-i21k   DP-Newton  10  78.2  66.5 71.0 71.4 71.9 71.9 72.3 73.0 74.2
vit-b16-i21k   DP-FC       1  72.9  71.9 72.1 72.5 72.9 72.9 72.9 72.9 72.9
vit-b16-i21k   DP-FC      10  77.1  71.8 71.9 72.1 75.4 76.3 76.8 77.0 77.1
vit-b16-i21k   DP-Adam     1  73.8     -    -    -    - 39.1 54.2 63.3 68.3
vit-b16-i21k   DP-Adam    10  76.1     -    - 22.1 52.9 62.3 66.6 69.5 71.0
vit-b16-i21k   DP-Adam   100  78.3     -    -    - 47.2 59.1 65.8 68.8 70.4
vit-g14-jft3b  DP-LS       1  87.5  82.4 83.8 84.1 85.8 86.2 86.4 86.6 86.7
vit-g14-jft3b  DP-Newton   1  85.9  77.8 80.3 81.0 82.9 83.6 84.0 84.5 84.9
vit-g14-jft3b  DP-Newton  10  88.9  76.0 79.7 80.1 81.8 82.9 83.1 84.7 85.3
vit-g14-jft3b  DP-FC       1  85.8  82.1 83.8 84.3 85.1 85.4 85.5 85.6 85.6
vit-g14-jft3b  DP-FC      10  88.4  81.0 83.1 83.7 86.1 86.8 87.4 87.8 88.0
vit-g14-jft3b  DP-Adam     1  84.8     - 68.7 74.0 82.1 83.7 84.4 84.8 84.8
vit-g14-jft3b  DP-Adam    10  87.3     - 70.5 75.6 83.4 84.9 85.6 86.3 86.7
vit-g14-jft3b  DP-Adam   100  88.6     - 49.7 64.4 78.3 81.5 83.9 85.4 86.3
""",
    "cifar10": """
vit-b16-i1k    DP-LS       1  91.3  81.1 83.7 84.3 86.3 87.7 88.7 89.6 90.3
vit-b16-i1k    DP-Newton   1  91.0  77.4 79.6 80.5 84.2 85.7 87.1 88.4 89.2
vit-b16-i1k    DP-Newton  10  91.6  79.7 81.4 82.7 86.1 87.5 89.0 88.6 90.2
vit-b16-i1k    DP-FC       1  91.0  79.0 81.5 83.1 86.6 88.0 88.9 89.7 90.3
vit-b16-i1k    DP-FC      10  91.1  81.2 84.7 86.5 89.5 90.4 91.0 91.1 91.1
vit-b16-i1k    DP-Adam     1  77.9  52.6 74.3 76.7 78.2 78.2 77.8 77.6 77.8
vit-b16-i1k    DP-Adam    10  82.3  56.4 78.3 76.7 82.0 82.6 82.4 82.2 82.7
vit-b16-i1k    DP-Adam   100  87.5  40.9 63.8 72.3 83.6 86.8 87.4 87.4 87.6
vit-b16-i21k   DP-LS       1  96.5  94.5 95.2 95.4 95.8 96.0 95.5 96.2 96.3
vit-b16-i21k   DP-Newton   1  96.5  94.3 94.9 95.2 95.6 95.7 96.0 96.1 96.2
vit-b16-i21k   DP-Newton  10  96.5  94.8 95.2 95.4 95.6 95.9 96.0 96.2 96.2
vit-b16-i21k   DP-FC       1  96.6  94.6 95.2 95.5 95.9 96.0 96.2 96.3 96.3
vit-b16-i21k   DP-FC      10  96.6  94.8 95.6 95.8 96.1 96.3 96.5 96.5 96.5
vit-b16-i21k   DP-Adam     1  95.2  90.0 94.7 95.1 95.1 95.1 95.1 95.1 95.2
vit-b16-i21k   DP-Adam    10  96.1  83.8 94.9 95.5 95.8 95.8 95.8 95.9 96.0
vit-b16-i21k   DP-Adam   100  96.5  64.0 90.0 93.3 95.5 95.7 95.9 96.1 96.2
vit-g14-jft3b  DP-LS       1  98.9  97.4 98.2 98.4 98.4 98.6 98.8 98.8 98.9
vit-g14-jft3b  DP-Newton   1  98.9  94.1 96.5 97.2 98.1 98.3 98.5 98.7 98.8
vit-g14-jft3b  DP-Newton  10  98.9  95.9 97.5 97.9 98.2 98.5 98.6 98.4 98.8
vit-g14-jft3b  DP-FC       1  98.9  95.2 97.6 97.9 98.5 98.6 98.8 98.8 98.9
vit-g14-jft3b  DP-FC      10  98.9  97.3 98.2 98.4 98.8 98.8 98.9 98.9 98.9
vit-g14-jft3b  DP-Adam     1  97.5  93.5 97.0 97.5 97.5 97.6 97.6 97.6 97.6
vit-g14-jft3b  DP-Adam    10  98.7  87.6 97.7 98.1 98.5 98.6 98.7 98.7 98.7
vit-g14-jft3b  DP-Adam   100  98.9  79.2 93.2 96.3 98.3 98.6 98.6 98.8 98.8
""",
    "cifar100": """
vit-b16-i1k    DP-LS       1  71.9  49.2 51.8 53.9 57.6 60.0 62.5 65.4 67.5
vit-b16-i1k    DP-Newton   1  68.8  44.6 48.6 49.3 50.2 51.2 54.4 57.2 59.5
vit-b16-i1k    DP-Newton  10  72.1  36.4 48.2 49.8 50.7 51.8 53.5 56.1 59.5
vit-b16-i1k    DP-FC       1  68.7  49.2 50.2 52.1 58.3 60.8 62.8 64.6 66.1
vit-b16-i1k    DP-FC      10  71.4  48.9 49.7 53.7 61.4 64.9 68.2 69.8 70.4
vit-b16-i1k    DP-Adam     1  52.1     - 26.0 34.6 47.6 51.2 51.7 51.7 52.2
vit-b16-i1k    DP-Adam    10  57.3     - 20.0 33.5 51.2 54.4 55.6 57.5 56.3
vit-b16-i1k    DP-Adam   100  67.9     -    -    - 36.3 40.2 51.5 58.4 63.7
vit-b16-i21k   DP-LS       1  83.9  77.2 77.7 78.1 79.8 80.7 81.4 81.9 82.4
vit-b16-i21k   DP-Newton   1  83.0  76.5 77.2 77.2 77.6 78.3 79.0 79.5 80.5
vit-b16-i21k   DP-Newton  10  83.0  73.6 77.4 77.8 78.3 78.9 79.6 80.4 81.4
vit-b16-i21k   DP-FC       1  83.0  77.1 77.5 78.2 80.0 80.9 81.6 81.9 82.4
vit-b16-i21k   DP-FC      10  84.3  77.1 77.1 78.5 81.6 82.7 83.3 83.8 83.9
vit-b16-i21k   DP-Adam     1  79.9  27.6 67.0 72.7 78.3 79.5 79.7 79.7 79.7
vit-b16-i21k   DP-Adam    10  82.0     - 55.7 67.5 78.6 80.7 81.5 81.5 81.6
vit-b16-i21k   DP-Adam   100  84.6     - 29.7 45.2 71.3 76.2 79.5 81.1 82.2
vit-g14-jft3b  DP-LS       1  90.6  74.9 80.3 82.5 85.5 86.4 87.7 88.4 88.9
vit-g14-jft3b  DP-Newton   1  89.9  73.1 72.6 73.4 78.5 80.9 82.8 84.6 85.9
vit-g14-jft3b  DP-Newton  10  89.9  69.6 75.7 76.7 77.4 77.6 80.0 82.9 85.4
vit-g14-jft3b  DP-FC       1  89.9  73.5 78.6 81.0 85.2 86.7 87.7 88.3 88.6
vit-g14-jft3b  DP-FC      10  90.1  72.1 75.9 79.0 86.2 88.1 89.0 90.0 90.1
vit-g14-jft3b  DP-Adam     1  83.5  27.9 61.8 71.3 79.7 82.1 83.4 83.5 83.5
vit-g14-jft3b  DP-Adam    10  88.2  21.9 60.2 69.7 81.9 83.9 86.2 86.8 87.8
vit-g14-jft3b  DP-Adam   100  90.0     - 29.4 50.5 73.7 78.7 83.1 86.1 88.0
""",
}

DATASETS = {
    # name: (printed name, table, δ, train / test split sizes)
    "imagenet": ("ImageNet-1k", 2, "8e-7", "1 281 167 train / 50 000 validation"),
    "cifar10": ("CIFAR-10", 3, "1e-5", "50 000 train / 10 000 test"),
    "cifar100": ("CIFAR-100", 4, "1e-5", "50 000 train / 10 000 test"),
}

FEATURES = {
    # folder name: (extractor, pre-training data, feature dimension)
    "vit-b16-i1k": ("ViT-B/16", "ImageNet-1k", 768),
    "vit-b16-i21k": ("ViT-B/16", "ImageNet-21k", 768),
    "vit-g14-jft3b": ("ViT-G/14", "JFT-3B", 1664),
}

METHODS = {
    # paper name: (dpvision method, hyper-parameter table of App. D)
    "DP-LS": ("dp-ls", 7),
    "DP-Newton": ("dp-newton", 8),
    "DP-FC": ("dp-fc", 9),
    "DP-Adam": ("dp-sgd-linear", 6),
}

BAND = 0.02  # ± 2 points: a rerun outside the band is flagged by `dpvision report`


def clip_norm(dataset: str, features: str) -> float:
    """C of Tables 6-9: 1.0 for ViT-G/14 (JFT-3B) features of ImageNet-1k, else 0.005."""
    return 1.0 if (dataset, features) == ("imagenet", "vit-g14-jft3b") else 0.005


def _line(setting: str, comment: str = "") -> str:
    """``key = value`` with its comment aligned at column 35."""
    return f"{setting:<33} # {comment}" if comment else setting


def learner_options(method: str, epochs: int, clip: float) -> list[str]:
    """The [learner] lines: the published setup, and dpvision's choice where the paper
    tuned a value with Vizier and did not print it."""
    public = "the authors' public config (dp_transfer)"
    ridge = _line('ridge = "auto"', "λ: dpvision's default, scaled to the noise")
    if method == "DP-LS":
        return [
            _line(f"clip_norm = {clip:g}", "C: features clipped to C, Gram matrices to C²"),
            _line("alpha = 2.0", f"α: {public}"),
            ridge,
        ]
    if method == "DP-Newton":
        return [
            _line(f"clip_norm = {clip:g}", "C: features clipped (gradient C, Hessian C²/4)"),
            _line(f"iterations = {epochs}", "one full-batch Newton step per epoch"),
            _line("learning_rate = 0.625", f"η: {public}"),
            ridge,
        ]
    if method == "DP-FC":
        return [
            _line(f"covariance_clip_norm = {clip:g}", "C for the shared feature covariance (C²)"),
            _line(f"clip_norm = {clip:g}", "C for each example's gradient"),
            _line(f"epochs = {epochs}", "full-batch preconditioned steps"),
            _line("learning_rate = 0.5", "η: dpvision's default"),
            ridge,
            _line("bias = -10.0", "the paper's fixed bias (sigmoid loss)"),
        ]
    return [
        _line(f"clip_norm = {clip:g}", "C: each example's gradient"),
        _line('optimizer = "adam"', "DP-Adam"),
        _line(f"epochs = {epochs}", "full batch: one step per epoch"),
        _line("learning_rate = 1e-4", f"η: {public}"),
        _line('loss = "sigmoid"', "one-vs-all sigmoid cross-entropy"),
        _line("bias_init = -10.0", "weights start at 0, the bias at -10"),
    ]


def _epsilon_name(epsilon: float) -> str:
    return f"{epsilon:g}".replace(".", "p")


def rows(dataset: str) -> list[tuple[str, str, int, str, list[str]]]:
    """(features, paper method, epochs, non-private accuracy, the 8 accuracies) per row."""
    out = []
    for line in TABLES[dataset].strip().splitlines():
        features, method, epochs, non_private, *cells = line.split()
        if len(cells) != len(EPSILONS):
            raise ValueError(f"{dataset}: {line!r} has {len(cells)} ε columns")
        out.append((features, method, int(epochs), non_private, cells))
    return out


def render(
    dataset: str,
    features: str,
    method: str,
    epochs: int,
    non_private: str,
    epsilon: float,
    cell: str,
) -> str:
    """The TOML text of one table cell."""
    printed, table, delta, splits = DATASETS[dataset]
    extractor, pretraining, dim = FEATURES[features]
    dp_method, hyper_table = METHODS[method]
    clip = clip_norm(dataset, features)
    epoch_word = "epoch" if epochs == 1 else "epochs"
    folder = f"features/{dataset}/{features}"
    what = f"{printed}, {extractor} ({pretraining}), {method}, {epochs} {epoch_word}"
    lines = [
        '# Mehta, Krichene, Thakurta, Kurakin & Cutkosky (2022), "Differentially Private Image',
        '# Classification from Features", arXiv 2211.13403 (shared/seeds/000).',
        f"# Table {table}: {printed}, features of {extractor} pre-trained on {pretraining}, "
        f"{method},",
        f"# {epochs} {epoch_word}, ε = {epsilon:g}, δ = {delta}. Published: "
        + ("accuracy ≤ 20 % (printed '-')." if cell == "-" else f"{cell} %.")
        + f" Non-private, same row: {non_private} %.",
        f"# Published setup (Sec. 3, App. D, Table {hyper_table}): full batch, last layer only,",
        "# weights initialised to 0; images upsampled to 384×384 and centre-cropped to 256×256",
        f"# before the extractor; per-example clip norm C = {clip:g}.",
        "# Not published: the paper tuned its step size / α and weight decay λ per cell with",
        "# Vizier (200-300 trials over [1e-8, 1e8]) and does not print the values. Where the",
        "# authors' public code (google-research/dp_transfer) sets one, it is used; else",
        "# dpvision's default. Expect to tune them on a validation split of your features.",
        "# Accounting: dpvision's exact Gaussian accountant, which calibrates less noise at the",
        "# same ε than the paper's zCDP bound (the result JSON gives that bound too).",
        "# Generated by configs/seed000/make_configs.py: edit that, not this file.",
        "",
        f'dataset = "{dataset}"',
        *(
            ["num_classes = 1000  # public: ImageNet-1k's label set"]
            if dataset == "imagenet"
            else []
        ),
        f'method = "{dp_method}"',
        f'features = "precomputed:path={folder}"',
        f"epsilon = {epsilon!r}",
        f"delta = {delta}",
        "seed = 0",
        "",
        "[learner]",
        *learner_options(method, epochs, clip),
        "",
        _line("[reference]", "the published number; not used by the run"),
        f'source = "Mehta et al. 2022, Table {table} ({what})"',
    ]
    if cell != "-":
        accuracy = float(cell) / 100
        low, high = max(0.0, accuracy - BAND), min(1.0, accuracy + BAND)
        lines += [
            f"accuracy = {accuracy:.3f}",
            f"epsilon = {epsilon!r}",
            _line(
                f"band = [{low:.3f}, {high:.3f}]",
                "± 2 points; `dpvision report` flags a run outside",
            ),
        ]
    else:
        lines.append(_line(f"epsilon = {epsilon!r}", "no accuracy: the paper prints '-' (≤ 20 %)"))
    lines.append(
        f'needs = "{dim}-d features of {printed} ({splits}) from {extractor} pre-trained on '
        f"{pretraining}, as x_train.npy, y_train.npy, x_test.npy, y_test.npy in {folder} "
        '(or add --set features=precomputed:path=DIR)"'
    )
    return "\n".join(lines) + "\n"


def write_all(root: Path) -> list[Path]:
    """Writes every config under ``root/<dataset>/``; returns their paths."""
    written = []
    for dataset in DATASETS:
        folder = root / dataset
        folder.mkdir(parents=True, exist_ok=True)
        for features, method, epochs, non_private, cells in rows(dataset):
            for epsilon, cell in zip(EPSILONS, cells, strict=True):
                name = (
                    f"{features.replace('-', '_')}_{METHODS[method][0].replace('-', '_')}"
                    f"_e{epochs}_eps{_epsilon_name(epsilon)}.toml"
                )
                path = folder / name
                path.write_text(
                    render(dataset, features, method, epochs, non_private, epsilon, cell),
                    encoding="utf-8",
                )
                written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent, help="folder to write into"
    )
    args = parser.parse_args()
    written = write_all(args.out)
    print(f"wrote {len(written)} configs under {args.out}")


if __name__ == "__main__":
    main()
