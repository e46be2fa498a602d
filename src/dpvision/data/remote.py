"""What dpvision can download: the files of each dataset, their mirrors and their published
checksums. :mod:`dpvision.data.sources` looks for them locally first, then downloads and
checks them."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Checksum:
    """One accepted digest of a file.

    Attributes:
        algorithm: ``"md5"`` or ``"sha256"``.
        hexdigest: Lower-case hexadecimal digest.
        note: Where the digest comes from.
    """

    algorithm: str
    hexdigest: str
    note: str = ""


@dataclass(frozen=True)
class RemoteFile:
    """A file to download.

    Attributes:
        filename: Name of the file in the cache folder (and on a mirror).
        urls: Official URLs, tried in order.
        checksums: Accepted digests; the file is kept if it matches any of them.
        unpack: Whether the file is a ``.tar.gz`` archive to unpack (and then delete).
    """

    filename: str
    urls: tuple[str, ...]
    checksums: tuple[Checksum, ...]
    unpack: bool = False


@dataclass(frozen=True)
class RemoteDataset:
    """The downloadable files of a named dataset.

    Attributes:
        name: Dataset name, e.g. ``"mnist"``.
        homepage: Where the dataset is published (for error messages).
        files: The files, each downloaded and verified separately.
    """

    name: str
    homepage: str
    files: tuple[RemoteFile, ...]


def _idx_files(
    bases: tuple[str, ...], md5s: dict[str, str], note: str, extra: dict[str, str] | None = None
) -> tuple[RemoteFile, ...]:
    """Registry entries for the four ``.gz`` files of an MNIST-style dataset."""
    files = []
    for filename, md5 in md5s.items():
        checksums = [Checksum("md5", md5, note)]
        if extra and filename in extra:
            checksums.append(
                Checksum(
                    "sha256",
                    extra[filename],
                    "re-compressed copy in circulation (gzip header without file name, dated "
                    "2020-06-05): same file, different gzip header",
                )
            )
        files.append(RemoteFile(filename, tuple(b + filename for b in bases), tuple(checksums)))
    return tuple(files)


DOWNLOADS: dict[str, RemoteDataset] = {
    "mnist": RemoteDataset(
        name="mnist",
        homepage="http://yann.lecun.com/exdb/mnist/",
        files=_idx_files(
            (
                "https://ossci-datasets.s3.amazonaws.com/mnist/",
                "http://yann.lecun.com/exdb/mnist/",
            ),
            {
                "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
                "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
                "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
                "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
            },
            "official MNIST files (torchvision MNIST.resources)",
        ),
    ),
    "fashion-mnist": RemoteDataset(
        name="fashion-mnist",
        homepage="https://github.com/zalandoresearch/fashion-mnist",
        files=_idx_files(
            (
                "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
                "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
            ),
            {
                "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
                "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
                "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
            },
            "published in the Fashion-MNIST README and torchvision FashionMNIST.resources",
            extra={
                "train-images-idx3-ubyte.gz": (
                    "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7"
                ),
                "train-labels-idx1-ubyte.gz": (
                    "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056"
                ),
                "t10k-images-idx3-ubyte.gz": (
                    "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa"
                ),
                "t10k-labels-idx1-ubyte.gz": (
                    "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05"
                ),
            },
        ),
    ),
    "cifar10": RemoteDataset(
        name="cifar10",
        homepage="https://www.cs.toronto.edu/~kriz/cifar.html",
        files=(
            RemoteFile(
                "cifar-10-python.tar.gz",
                ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
                (Checksum("md5", "c58f30108f718f92721af3b95e74349a", "cifar.html, torchvision"),),
                unpack=True,
            ),
        ),
    ),
    "cifar100": RemoteDataset(
        name="cifar100",
        homepage="https://www.cs.toronto.edu/~kriz/cifar.html",
        files=(
            RemoteFile(
                "cifar-100-python.tar.gz",
                ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
                (Checksum("md5", "eb9058c3a382ffc7106e4002c42a8d85", "cifar.html, torchvision"),),
                unpack=True,
            ),
        ),
    ),
    "dermamnist": RemoteDataset(
        name="dermamnist",
        homepage="https://medmnist.com/",
        files=(
            RemoteFile(
                "dermamnist.npz",
                ("https://zenodo.org/records/10519652/files/dermamnist.npz?download=1",),
                (Checksum("md5", "0744692d530f8e62ec473284d019b0c7", "MedMNIST INFO (28x28)"),),
            ),
        ),
    ),
}
