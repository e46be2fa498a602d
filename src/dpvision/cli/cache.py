"""``dpvision cache list | clear``: the feature cache and the downloaded datasets.

Privacy: a local command on the private cache: ``list`` names each entry by its file stem,
which holds a digest of a fingerprint of the dataset's images (as private as the cached
features; never in a run's published log). It releases nothing.
"""

# local imports: start-up time (heavy modules are imported in the functions using them)
import argparse
import shutil
import time
from typing import Any

from dpvision.cli.arguments import Parser, positive_float
from dpvision.errors import DPVisionError


def add_parser(commands: Any) -> None:
    cache = commands.add_parser(
        "cache",
        help="list or clear the feature cache and the downloaded datasets",
        description="The feature cache ($DPVISION_CACHE, else ~/.cache/dpvision/features) "
        "holds extracted features, one entry per dataset and feature spec; the download "
        "cache (~/.cache/dpvision/NAME) holds datasets dpvision downloaded. Both are made "
        "again when needed. Entries hold features of private data: the files are readable "
        "by their owner only. Entry names hold a digest of the dataset's images: this "
        "command's output is as private as the cache (a run's log names the folder only).",
    )
    actions = cache.add_subparsers(
        dest="action", required=True, parser_class=Parser, metavar="ACTION"
    )
    actions.add_parser("list", help="every entry with its size and age")
    clear = actions.add_parser(
        "clear", help="delete feature-cache entries (and, with --datasets, downloaded datasets)"
    )
    clear.add_argument(
        "--dataset",
        metavar="NAME",
        help="only entries of this dataset (a name, or npz:PATH, npy:PATH, imagefolder:PATH: "
        "the same file or folder, its path given relative or absolute)",
    )
    clear.add_argument(
        "--older-than",
        type=positive_float,
        metavar="DAYS",
        help="only entries not used for DAYS days",
    )
    clear.add_argument("--datasets", action="store_true", help="also the downloaded datasets")
    clear.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")


def _size(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024  # type: ignore[assignment]
    raise AssertionError


def _age(modified: float) -> str:
    days = (time.time() - modified) / 86400
    return f"{days * 24:.0f} h" if days < 2 else f"{days:.0f} d"


def _print_table(rows: list[list[str]], right: tuple[int, ...] = ()) -> None:
    """Prints ``rows`` indented, each column as wide as its widest cell (a long dataset
    name or spec widens its column rather than shifting the rest of its row); the columns
    in ``right`` are right-aligned, the last column is not padded."""
    if not rows:
        return
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            cell if i == len(row) - 1 else cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  " + "  ".join(cells).rstrip())


def _downloads() -> list[tuple[str, Any, int, float]]:
    from dpvision.data.sources import DOWNLOADS, cache_dir

    found = []
    for name in sorted(DOWNLOADS):
        folder = cache_dir(name)
        if folder.is_dir():
            files = [p for p in folder.rglob("*") if p.is_file()]
            size = sum(p.stat().st_size for p in files)
            modified = max((p.stat().st_mtime for p in files), default=folder.stat().st_mtime)
            found.append((name, folder, size, modified))
    return found


def run(args: argparse.Namespace) -> None:
    from dpvision.data.datasets import same_dataset
    from dpvision.features.cache import cache_entries, default_cache_dir

    entries = cache_entries()
    downloads = _downloads()
    if args.action == "list":
        print(
            f"feature cache {default_cache_dir()}: {len(entries)} entries, "
            f"{_size(sum(e.size for e in entries))}"
        )
        rows = [
            [
                entry.dataset,
                entry.spec,
                _size(entry.size),
                f"{_age(entry.modified)} ago",
                entry.stem + ("" if entry.complete else "  (incomplete: an interrupted write)"),
            ]
            for entry in entries
        ]
        _print_table(rows, right=(2, 3))
        print(f"downloaded datasets: {len(downloads)}")
        _print_table(
            [
                [name, _size(size), f"{_age(modified)} ago", str(folder)]
                for name, folder, size, modified in downloads
            ],
            right=(1, 2),
        )
        return
    cutoff = time.time() - 86400 * args.older_than if args.older_than is not None else None
    doomed_entries = [
        e
        for e in entries
        if (args.dataset is None or e.belongs_to(args.dataset))
        and (cutoff is None or e.modified < cutoff)
    ]
    doomed_downloads = [
        d
        for d in downloads
        if args.datasets
        and (args.dataset is None or same_dataset(d[0], args.dataset))
        and (cutoff is None or d[3] < cutoff)
    ]
    freed = sum(e.size for e in doomed_entries) + sum(d[2] for d in doomed_downloads)
    verb = "would delete" if args.dry_run else "deleted"
    if not args.dry_run:
        try:
            for entry in doomed_entries:
                for path in entry.files:
                    path.unlink(missing_ok=True)
            for _, folder, _, _ in doomed_downloads:
                shutil.rmtree(folder)
        except OSError as error:
            raise DPVisionError(f"cannot delete {error.filename}: {error.strerror}") from None
    print(
        f"{verb} {len(doomed_entries)} feature-cache entries and {len(doomed_downloads)} "
        f"downloaded datasets ({_size(freed)})"
    )
