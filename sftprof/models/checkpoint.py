"""Read-only, memory-mapped access to a Hugging Face safetensors checkpoint, one slice at a time.

A 30B-parameter checkpoint is ~61 GB in bf16: no rank may hold it whole in host memory. A
:class:`SafetensorsCheckpoint` opens each shard with ``safetensors.safe_open`` (which memory-maps the
file) and reads only the slices a rank asks for (``get_slice(name)[rows, cols]``), so a rank's host
memory holds just the tensors of its own shard. Every tensor read is recorded in ``consumed`` so the
loader can prove that each checkpoint tensor went somewhere (:func:`check_all_consumed`).

Layouts accepted (what ``PreTrainedModel.save_pretrained`` writes): ``model.safetensors.index.json``
plus the shard files it names, or a single ``model.safetensors``.

:class:`TensorSource` is the interface the per-family mapping modules read through; :class:`DictSource`
serves in-memory tensors (for example a Hugging Face model's gradients) through the same interface, so
one mapping both loads weights and maps reference gradients onto a rank's shard.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable, Protocol, Set, Tuple

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_PATTERN = "model-*-of-*.safetensors"  # save_pretrained's shard names (model-00001-of-00016.safetensors)


class CheckpointError(ValueError):
    """A checkpoint file is missing, damaged, or lacks / leaves over tensors; the message names the file
    or the tensor names."""


class TensorSource(Protocol):
    """Named tensors that can be read a slice at a time (``Tensor.__getitem__`` index syntax)."""

    def shape(self, name: str) -> Tuple[int, ...]:
        """Full shape of tensor ``name``; raises :class:`CheckpointError` when it does not exist."""

    def read(self, name: str, index=...) -> torch.Tensor:
        """``tensor[index]`` of tensor ``name`` (a basic index: slices and ints); records ``name`` as consumed."""

    def __contains__(self, name: str) -> bool: ...


class DictSource:
    """:class:`TensorSource` over a ``{name: tensor}`` dict (tensors stay where they are)."""

    def __init__(self, tensors: Dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.consumed: Set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> Tuple[int, ...]:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name!r} is missing")
        return tuple(self.tensors[name].shape)

    def read(self, name: str, index=...) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name!r} is missing")
        self.consumed.add(name)
        return self.tensors[name][index]


class SafetensorsCheckpoint:
    """Lazy slice reads from the safetensors checkpoint in ``model_dir`` (see the module docstring).

    Args:
        model_dir: directory holding ``model.safetensors.index.json`` and its shards, or ``model.safetensors``.
    Attributes:
        listing: the file that lists the tensors (the index, or the single ``model.safetensors``).
        names: every tensor name in the checkpoint (as listed).
        consumed: names read so far (any slice counts).
        bytes_read: bytes of tensor data read so far (slices only; int).
    Raises:
        CheckpointError: neither layout is present; the index is not valid JSON or lacks ``weight_map``;
            a shard named by the index is missing or is not a readable safetensors file.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / INDEX_NAME
        single = self.model_dir / SINGLE_NAME
        self._handles: Dict[str, object] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: not a safetensors index (JSON with a 'weight_map' object): {err}") from err
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: 'weight_map' is not an object of tensor name -> shard file")
            self._file_of: Dict[str, str] = {str(k): str(v) for k, v in weight_map.items()}
            for fname in sorted(set(self._file_of.values())):
                if not (self.model_dir / fname).is_file():
                    raise CheckpointError(f"{self.model_dir / fname}: shard named by {INDEX_NAME} is missing")
        elif single.is_file():
            self._file_of = {name: SINGLE_NAME for name in self._open(SINGLE_NAME).keys()}
        else:
            raise CheckpointError(f"{self.model_dir}: no {INDEX_NAME} or {SINGLE_NAME} (safetensors checkpoint "
                                  "as written by transformers' save_pretrained)")
        self.listing = index if index.is_file() else single
        self.names: Set[str] = set(self._file_of)
        self.consumed: Set[str] = set()
        self.bytes_read = 0

    def _open(self, fname: str):
        handle = self._handles.get(fname)
        if handle is None:
            from safetensors import safe_open

            try:
                handle = safe_open(str(self.model_dir / fname), framework="pt", device="cpu")
            except Exception as err:  # safetensors raises its own error types for damaged headers
                raise CheckpointError(f"{self.model_dir / fname}: not a readable safetensors file: {err}") from err
            self._handles[fname] = handle
        return handle

    def check_shards(self) -> None:
        """Open every shard (memory-mapped: only each file's header is read, no tensor data) and match the index
        against the headers: each tensor the index places in a shard is in that shard, and each shard holds only
        tensors the index places in it (a file named like a shard, :data:`SHARD_PATTERN`, that the index leaves
        out holds none).

        Raises:
            CheckpointError: a shard is not a readable safetensors file, or lacks tensors the index places in it, or
                holds tensors the index does not name there (the message names each such shard and its tensors).
        """
        problems = []
        shards = set(self._file_of.values())
        if self.listing.name == INDEX_NAME:  # shards named as save_pretrained names them but left out of the index
            shards.update(p.name for p in self.model_dir.glob(SHARD_PATTERN))
        for fname in sorted(shards):
            held = set(self._open(fname).keys())
            promised = {name for name, f in self._file_of.items() if f == fname}
            if promised - held:
                problems.append(f"{self.model_dir / fname} lacks {len(promised - held)} tensor(s) that {INDEX_NAME} "
                                f"places in it: {name_list(promised - held)}")
            if held - promised:
                problems.append(f"{self.model_dir / fname} holds {len(held - promised)} tensor(s) that {INDEX_NAME} "
                                f"does not place in it: {name_list(held - promised)}")
        if problems:
            raise CheckpointError("; ".join(problems) + "; accepted: an index whose weight_map names exactly the "
                                  "tensors of each shard (as save_pretrained writes it)")

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _slice(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        try:
            return self._open(self._file_of[name]).get_slice(name)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{self.model_dir / self._file_of[name]}: cannot read tensor {name!r}: {err}") from err

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index=...) -> torch.Tensor:
        sl = self._slice(name)
        try:
            t = sl[index] if index is not ... else sl[:]
        except Exception as err:
            raise CheckpointError(f"{self.model_dir / self._file_of[name]}: cannot read {name!r}{index!r}: {err}") from err
        self.consumed.add(name)
        self.bytes_read += t.numel() * t.element_size()
        return t


def check_all_consumed(names: Iterable[str], consumed_per_rank: Iterable[Iterable[str]], where: str) -> None:
    """Raise unless every checkpoint tensor was read by at least one rank.

    Args:
        names: all tensor names of the checkpoint.
        consumed_per_rank: the ``consumed`` set of each rank.
        where: the checkpoint path, for the message.
    Raises:
        CheckpointError: names that no rank read (:func:`name_list`).
    """
    used: Set[str] = set()
    for c in consumed_per_rank:
        used.update(c)
    left = set(names) - used
    if left:
        raise CheckpointError(f"{where}: {len(left)} checkpoint tensor(s) were not loaded into the model: "
                              f"{name_list(left)}")


def name_list(names: Iterable[str], limit: int = 20) -> str:
    """Tensor names for a message: the first ``limit`` sorted names, ``" ..."`` after them when there are more."""
    names = sorted(names)
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")
