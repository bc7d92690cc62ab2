"""Which part of every layer each rank owns: the shard layout of ZeRO in this trainer.

    layout = ShardLayout(model, world_size=3, rank=1)
    layout.own(l)       # slice of layer l's flat range that rank 1 owns
    layout.shard_elems  # elements rank 1 owns over all layers (they sum to num_params over ranks)

Each LAYER's flat slice ``[W_l, b_l]`` is cut into ``world_size`` chunks with ``chunk_bounds``,
and rank r owns chunk r of every layer. That is exactly the chunk a reduce-scatter of the
layer's gradient leaves summed on rank r, and the chunk rank r contributes to the layer's
all-gather, so no collective ever needs a copy or a repacking. Sharding per layer (not the flat
vector once) is what lets stage 3 gather one layer at a time and stage 2 reduce-scatter a layer
the moment the backward pass yields it. Any sizes work: the first n mod p ranks get one element
more, and a layer smaller than the world leaves some ranks an empty chunk.

    layer sizes 10 and 4 on 3 ranks:   layer 0: [0:4 | 4:7 | 7:10]   layer 1: [0:2 | 2:3 | 3:4]
    rank 1 owns 3 + 1 = 4 elements; ranks 0, 1, 2 own 6, 4, 4 (sum 14)
"""

from __future__ import annotations

from dplab.reference.model import MLP
from dplab.reference.schedule import chunk_bounds

__all__ = ["ShardLayout"]


class ShardLayout:
    """Layer slices of the flat vector and rank ``rank``'s chunk of each.

    Args:
        model: the MLP.
        world_size: the number of ranks.
        rank: this rank.
    """

    def __init__(self, model: MLP, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.layers = [model.layer_slice(layer) for layer in range(model.num_layers)]
        self.sizes = [s.stop - s.start for s in self.layers]
        self._own = [slice(*chunk_bounds(n, world_size)[rank]) for n in self.sizes]
        self.shard_elems = sum(s.stop - s.start for s in self._own)

    def own(self, layer: int) -> slice:
        """This rank's chunk of ``layer``, relative to the layer's own flat range.

        Args:
            layer: the layer.

        Returns:
            A slice of the layer's flat range.
        """
        return self._own[layer]

    def own_size(self, layer: int) -> int:
        """The number of elements of ``layer`` this rank owns.

        Args:
            layer: the layer.

        Returns:
            The length of ``own(layer)``.
        """
        return self._own[layer].stop - self._own[layer].start
