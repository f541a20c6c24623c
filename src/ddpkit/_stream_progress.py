"""What a stream's epoch has taken so far, in the plain data a checkpoint stores, and the test for a taken item.

A stream has no global order, so a mid-epoch checkpoint stores which items
were taken instead of a position. Each run of the epoch (the first, then each
resume) adds a *layer*, whose stored form is plain lists (so checkpoints load
with ``weights_only=True``):

* ``["shard", [[shard, items taken], ...]]``: split by shard, each shard read
  from its start by one unit (:class:`ShardLayer`);
* ``["example", units, [last index taken by each unit, or -1]]``: split by
  example, unit ``u`` reading the indices ``u, u + units, ...``
  (:class:`ExampleLayer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = ["ExampleLayer", "Layer", "ShardLayer", "StreamProgress", "TakenItems"]


@dataclass
class ShardLayer:
    """Items taken per shard (each shard read from its start)."""

    taken: dict[int, int] = field(default_factory=dict)

    def plain(self) -> list[Any]:
        return ["shard", sorted([shard, count] for shard, count in self.taken.items())]


@dataclass
class ExampleLayer:
    """The last index each of ``units`` units took (-1: none yet)."""

    units: int
    last: list[int]

    def plain(self) -> list[Any]:
        return ["example", self.units, list(self.last)]


Layer = ShardLayer | ExampleLayer


def parse_layer(plain: list[Any]) -> Layer:
    """A layer from its stored form.

    Raises:
        ValueError: not a layer of either kind.
    """
    if plain and plain[0] == "shard" and len(plain) == 2:
        return ShardLayer({int(shard): int(count) for shard, count in plain[1]})
    if plain and plain[0] == "example" and len(plain) == 3:
        return ExampleLayer(int(plain[1]), [int(value) for value in plain[2]])
    raise ValueError(f"not a stream checkpoint layer: {plain!r}")


class StreamProgress:
    """The items of an epoch of a stream one rank has taken, in a form a checkpoint stores (plain data)."""

    def __init__(self, split: Literal["shard", "example"] = "example", units: int = 1) -> None:
        self.split, self.units = split, units
        #: Layers of earlier runs of this epoch (a resumed epoch), in their stored form.
        self.previous: list[Any] = []
        self._layer: Layer = ShardLayer() if split == "shard" else ExampleLayer(units, [-1] * units)

    def add(self, keys: torch.Tensor) -> None:
        """Count the items of a batch (its keys ``(shard, offset, index)``, shape ``(batch, 3)``)."""
        layer = self._layer
        if isinstance(layer, ShardLayer):
            for shard, offset in keys[:, :2].tolist():
                layer.taken[shard] = max(layer.taken.get(shard, 0), offset + 1)
        else:
            for index in keys[:, 2].tolist():
                unit = index % layer.units
                layer.last[unit] = max(layer.last[unit], index)

    def layer(self) -> list[Any]:
        """This run's layer, stored form."""
        return self._layer.plain()

    @staticmethod
    def merged(every_rank: list[list[Any]]) -> list[Any]:
        """One state from every rank's ``[*previous, layer]`` (the same previous layers, disjoint layers)."""
        previous, layers = every_rank[0][:-1], [parse_layer(state[-1]) for state in every_rank]
        if all(isinstance(layer, ShardLayer) for layer in layers):
            taken: dict[int, int] = {}
            for layer in layers:
                assert isinstance(layer, ShardLayer)
                for shard, count in layer.taken.items():
                    taken[shard] = max(taken.get(shard, 0), count)
            return [*previous, ShardLayer(taken).plain()]
        examples = [layer for layer in layers if isinstance(layer, ExampleLayer)]
        if len(examples) != len(layers):
            raise ValueError("the ranks split the stream differently (by shard on some, by example on others)")
        last = [max(values) for values in zip(*(layer.last for layer in examples), strict=True)]
        return [*previous, ExampleLayer(examples[0].units, last).plain()]

    def state(self) -> list[Any]:
        """``[*previous, layer]``, stored form."""
        return [*self.previous, self.layer()]


class TakenItems:
    """Whether a key ``(shard, offset, index)`` was taken in an earlier run of the epoch (by any layer)."""

    def __init__(self, layers: tuple[Any, ...]) -> None:
        parsed = [parse_layer(list(layer)) for layer in layers]
        self.shards = [layer.taken for layer in parsed if isinstance(layer, ShardLayer)]
        self.examples = [layer for layer in parsed if isinstance(layer, ExampleLayer)]

    def __bool__(self) -> bool:
        return bool(self.shards or self.examples)

    def __call__(self, key: tuple[int, int, int]) -> bool:
        shard, offset, index = key
        if any(offset < taken.get(shard, 0) for taken in self.shards):
            return True
        return any(0 <= index <= layer.last[index % layer.units] for layer in self.examples)
