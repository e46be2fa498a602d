"""The secret randomness of one ``make_private`` call, derived as ``dpvision.train`` derives
a run's (:mod:`dpvision.mechanisms.secret`): from the secret seed and the call's *context*,
then keyed by the training rows.

The context is what the call is: its arguments (σ, C, q, N, the clip policy and its options,
K, the public seed, ...), the optimizer's kind and hyper-parameters, and a digest of the
module's initial parameters and buffers. Two scripts of a sweep that reuse one secret seed
therefore never share their noise or their batches when any of these differ (σ = 1 and 2,
ε = 1 and 4, two learning rates), and a rerun on a dataset with one example added or
removed draws other noise too (:meth:`~dpvision.mechanisms.secret.SecretRandomness.bind_rows`
over a digest of the loader's dataset). Without a secret seed the call's secret is 256
fresh bits of OS entropy and none of this is computed.

What ``make_private`` cannot see is not in the context: the training loop that follows
(the loss given to ``per_example_loss``, a learning rate changed later). Two scripts that
differ only there draw the same noise under one secret seed, and publishing both gives
back the difference of their exact releases: reuse a secret seed only to replay the same
script (docs/guarantees.md).
"""

import hashlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset

from dpvision.mechanisms.noise import NoiseGenerator
from dpvision.mechanisms.secret import SecretRandomness, canonical_context, check_secret_seed

__all__ = [
    "call_noise",
    "call_secret",
    "dataset_digest",
    "module_structure",
    "optimizer_settings",
    "parameters_digest",
]


# make_private's arguments that are objects rather than settings: the optimizer and the
# module enter the context by their own digests, the data by the rows' binding.
_OBJECTS = ("self", "module", "optimizer", "data_loader", "noise_generator", "secret_seed")


def call_secret(
    secret_seed: int | None, *, secure: bool, arguments: Mapping[str, Any], call: int
) -> SecretRandomness:
    """The secret randomness of ``make_private`` call number ``call`` of an engine, given
    the call's ``arguments`` (by name, as passed): fresh OS bits, or (with ``secret_seed``)
    derived from the seed and the call's context — its other arguments,
    :func:`optimizer_settings`, :func:`parameters_digest` of the module — and bound to
    :func:`dataset_digest` of the data loader's dataset.

    Privacy:
      Releases nothing: the context and the digests only key secret streams and are never
      written anywhere.
    """
    if check_secret_seed(secret_seed) is None or secure:
        return SecretRandomness(secret_seed, secure=secure)  # refuses a seed with secure
    module, optimizer = arguments["module"], arguments["optimizer"]
    loader = arguments["data_loader"]
    dataset = loader.dataset
    context = {
        "entry": "PrivacyEngine.make_private",
        "call": call,
        **{k: _plain(v) for k, v in arguments.items() if k not in _OBJECTS},
        # q = batch_size / N and what the loader reads
        "data_loader": {
            "batch_size": loader.batch_size,
            "num_examples": len(dataset),
            "dataset": type(dataset).__qualname__,
            "collate_fn": _plain(loader.collate_fn),
        },
        "optimizer": optimizer_settings(optimizer),
        "module": module_structure(module),
        "initial_parameters": parameters_digest(module),
    }
    secret = SecretRandomness(secret_seed, context=canonical_context(context))
    return secret.bind_rows(lambda: (np.frombuffer(dataset_digest(dataset), np.uint8),))


def call_noise(
    given: torch.Generator | None, secret: SecretRandomness, call: int, module: nn.Module
) -> NoiseGenerator:
    """The noise of ``make_private`` call number ``call``: the caller's generator as given,
    else the call's stream of ``secret`` on the module's device."""
    if given is not None:
        return given
    device = next(p.device for p in module.parameters() if p.requires_grad)
    return secret.noise(f"noise {call}", device)


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The optimizer's kind and each parameter group's hyper-parameters (lr, momentum,
    weight decay, ...) and number of parameters.

    >>> layer = nn.Linear(2, 1)
    >>> optimizer_settings(torch.optim.SGD(layer.parameters(), lr=0.5))[0]
    'SGD'
    """
    groups = [
        {
            **{k: _plain(v) for k, v in group.items() if k != "params"},
            "num_params": len(group["params"]),
        }
        for group in optimizer.param_groups
    ]
    return [type(optimizer).__name__, groups]


def module_structure(module: nn.Module) -> list[str]:
    """The module's architecture: its ``repr`` (layers, shapes, activations) and a digest of
    the source of every submodule's class (a ``forward`` that calls ``F.relu`` or
    ``F.tanh``), where Python can read it.

    >>> tanh = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    >>> module_structure(tanh) == module_structure(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    False
    """
    classes = sorted({_source_digest(type(m)) for m in module.modules()})
    return [repr(module), *classes]


def parameters_digest(module: nn.Module) -> str:
    """A digest of the module's state: every parameter and buffer, named, with its dtype,
    shape and values (its initialisation, as the public ``seed`` or the caller drew it)."""
    hasher = hashlib.blake2b(b"dpvision initial parameters v1", digest_size=32)
    for name, tensor in module.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            hasher.update(name.encode() + b"\0")
            _update(hasher, tensor)
    return hasher.hexdigest()


def dataset_digest(dataset: Dataset[Any]) -> bytes:
    """A digest of a data loader's dataset, example by example: the tensors of a
    ``TensorDataset``, the indices and base of a ``Subset``, otherwise every item read in
    order (numbers, strings, arrays, tensors, images, nested in tuples, lists or dicts),
    with torch's random state fixed while they are read so that a random transform reads
    the same each time. One pass over the data, and only for a ``secret_seed`` call.

    Privacy:
      Secret: it keys the call's secret streams and is never written anywhere.
    """
    hasher = hashlib.blake2b(b"dpvision dataset rows v1", digest_size=32)
    for value in _dataset_values(dataset):
        _update(hasher, value)
    return hasher.digest()


def _dataset_values(dataset: Dataset[Any]) -> Iterator[Any]:
    if isinstance(dataset, TensorDataset):
        yield from dataset.tensors
        return
    if isinstance(dataset, Subset):
        yield np.asarray(list(dataset.indices), dtype=np.int64)
        yield from _dataset_values(dataset.dataset)
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for index in range(len(dataset)):  # type: ignore[arg-type]
            yield from _leaves(dataset[index])


def _leaves(item: Any) -> Iterator[Any]:
    if isinstance(item, Mapping):
        for key in sorted(item, key=str):
            yield str(key)
            yield from _leaves(item[key])
    elif isinstance(item, (tuple, list)):
        yield len(item)
        for value in item:
            yield from _leaves(value)
    else:
        yield item


def _update(hasher: Any, value: Any) -> None:
    """Feeds one value to ``hasher``: its kind, dtype, shape and bytes."""
    if isinstance(value, str):
        hasher.update(b"s" + value.encode() + b"\0")
        return
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        value = value.contiguous().numpy()
    array = np.ascontiguousarray(np.asarray(value))
    if array.dtype == object:
        hasher.update(b"o" + repr(value).encode() + b"\0")
        return
    hasher.update(f"a{array.dtype.str}{array.shape};".encode())
    hasher.update(array.reshape(-1).view(np.uint8).data)


def _plain(value: Any) -> Any:
    """A setting as JSON can write it: tensors as lists; a module (a criterion) by its type,
    its public attributes (``label_smoothing``, ``ignore_index``, ...) and its state; a
    function by its name and source; anything else by its type and ``repr``."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, nn.Module):
        public = {k: _plain(v) for k, v in vars(value).items() if not k.startswith("_")}
        return [module_structure(value), public, parameters_digest(value)]
    if callable(value):
        return [getattr(value, "__qualname__", type(value).__qualname__), _source_digest(value)]
    return f"{type(value).__qualname__}: {value!r}"


def _source_digest(thing: Any) -> str:
    """The qualified name of a class or function and a digest of its source (the name
    alone where Python cannot read the source: built-ins, an interactive session)."""
    name = f"{getattr(thing, '__module__', '')}.{getattr(thing, '__qualname__', repr(thing))}"
    try:
        source = inspect.getsource(thing)
    except (OSError, TypeError):
        return name
    return f"{name}:{hashlib.blake2b(source.encode(), digest_size=16).hexdigest()}"
