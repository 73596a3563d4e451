"""Per-block batching of the zoo's deduplicated own blocks in the worker's delta pool (BlockLLM §4.1).

``ft2`` is ``ft1`` with layer 0 changed too (``conftest``): both variants' layers 1 and 2 are the same
own blocks (one file each in the zoo, hard-linked into both variant directories). With both resident:
each shared block is held once on the GPU (one block slot of its layer), the rows of both variants
run it as one group of that layer's SBMM call (the metadata one variant's rows would have), layer 0
runs ft2's block for ft2's rows only, and ft1's rows do no SBMM work there. A block stays while a
resident variant uses it. Greedy tokens through the daemon, both variants in one batch with base and
LoRA rows: ``test_serving``.
"""

from __future__ import annotations

import pytest

from deltaserve.adapters.delta_pool import DeltaPool
from deltaserve.adapters.variants import StepRows
from deltaserve.kernels.sbmm import DeltaMeta
from helpers.executors import make_executor

from .conftest import ZooFixture

FT1, FT2 = 7, 8
"""Variant ids."""


def loaded_slots(pool: DeltaPool, layer: int, proj: str) -> int:
    """Slots holding a delta of ``(layer, proj)`` over every packed config's pool."""
    return sum(sum(w[(layer, proj)].loaded) for w in pool.step.weights.values())


@pytest.fixture(scope="module")
def pool(zoo_fixture: ZooFixture):
    ex = make_executor(zoo_fixture.base, max_deltas=2)
    pool = ex.delta_pool
    assert pool is not None
    for vid, name in ((FT1, "ft1"), (FT2, "ft2")):
        pool.to_host(vid, zoo_fixture.zoo / "variants" / name)
    yield pool
    ex.close()


def test_a_shared_block_is_held_once_and_batched_as_one(pool: DeltaPool) -> None:
    pool.to_gpu(FT1, 0)
    ft1 = pool.piece_slots[FT1]
    assert ft1[:2] == (-1, -1), "layer 0 is the base's: no piece, no SBMM work"
    assert ft1[2:6] == (0,) * 4 and ft1[6:] == (-1, -1)  # layers 1-2 its own; embedding and head the base's
    pool.to_gpu(FT2, 1)
    ft2 = pool.piece_slots[FT2]
    assert ft2[:2] == (1, 1) and ft2[2:] == ft1[2:], "layers 1-2 are ft1's blocks: the same slots"
    assert pool.blocks.held_counts() == [1] * 6 + [0, 0]  # without sharing: [1, 1, 2, 2, 2, 2, 0, 0]
    for layer in range(3):
        assert loaded_slots(pool, layer, "q_proj") == 1 and loaded_slots(pool, layer, "down_proj") == 1

    assert pool.begin_step(StepRows(runs=[(FT1, 1), (FT2, 1), (0, 1)], logit_ids=[FT1, FT2, 0], decode=True))
    try:
        metas = pool.step.piece_metas
        (_, shared), *rest = metas[2]  # layer 1's attention: one config, one group of both variants' rows
        assert not rest and shared.slot_tokens == ((0, (0, 1)),) and shared.num_tiles == 1
        one_variant = DeltaMeta.rows([0, 0, -1], "cpu", max_block_m=pool.tile_cap)
        assert shared.order.tolist() == one_variant.order.tolist()  # what one variant's two rows cost
        assert shared.tiles.tolist() == one_variant.tiles.tolist()
        (_, own), *rest = metas[0]  # layer 0: ft2's own block, for ft2's row only
        assert not rest and own.slot_tokens == ((1, (1,)),)
    finally:
        pool.end_step()

    pool.drop_gpu(FT1)  # ft2 still uses the shared blocks: they stay
    assert pool.blocks.held_counts() == [1] * 6 + [0, 0] and loaded_slots(pool, 1, "q_proj") == 1
    pool.to_gpu(FT1, 0)  # back: nothing copied again, the shared blocks gain a user
    assert pool.piece_slots[FT1][2:] == ft2[2:] and pool.blocks.held_counts() == [1] * 6 + [0, 0]
    pool.drop_gpu(FT2)
    assert pool.blocks.held_counts() == [0, 0, 1, 1, 1, 1, 0, 0] and loaded_slots(pool, 0, "q_proj") == 0
    pool.drop_gpu(FT1)
    assert pool.blocks.held_counts() == [0] * 8 and loaded_slots(pool, 1, "q_proj") == 0


def test_variants_copied_without_links_share_nothing(pool: DeltaPool, zoo_fixture: ZooFixture, tmp_path) -> None:
    """A piece is identified by its payload file: a copy (not a hard link) of a block is another piece
    (held twice, never mixed up with the zoo's)."""
    import shutil

    copy = tmp_path / "ft1-copy"
    shutil.copytree(zoo_fixture.zoo / "variants" / "ft1", copy)
    pool.to_host(9, copy)
    pool.to_gpu(FT1, 0)
    pool.to_gpu(9, 1)
    try:
        assert pool.blocks.held_counts() == [0, 0, 2, 2, 2, 2, 0, 0]
        assert pool.piece_slots[9][2:6] == (1,) * 4
    finally:
        pool.drop_gpu(9)
        pool.drop_gpu(FT1)
        pool.drop_host(9)


def test_captured_decode_buffers_hold_each_pieces_rows(pool: DeltaPool) -> None:
    """What a captured decode step reads (``delta_graphs``): per piece, the rows at their block slots;
    ft1's row has no layer-0 piece, and at layer 1 both variants' rows are one tile of one slot."""
    from deltaserve.adapters.delta_pool import GRAPH_TILE

    pool.to_gpu(FT1, 0)
    pool.to_gpu(FT2, 1)
    try:
        keys = pool.graph_keys([FT1, FT2])
        with pool.graph_state(4, 8, keys):
            assert len(pool.step.piece_metas) == pool.num_pieces and pool.step.embed_index.tolist() == [0] * 4
        pool.fill_graph_rows([FT1, FT2, 0], 4, keys)
        g = pool.graph_rows
        order, tiles, count = g.metas[keys[0]]
        grid = pool.graph_tiles(4, GRAPH_TILE)

        def piece(p: int) -> list[list[int]]:
            return tiles[p * grid * 3 : (p + 1) * grid * 3].view(grid, 3)[: int(count[p])].tolist()

        assert piece(0) == [[0, 1, 1]] and order[0] == 1  # layer 0's attention: ft2's row, slot 1
        assert piece(2) == [[0, 2, 0]] and order[2 * 4 : 2 * 4 + 2].tolist() == [0, 1]  # one tile, both rows
        assert g.index[:4].tolist() == [1, 2, 0, 0] and g.embed_index[:4].tolist() == [0] * 4
    finally:
        pool.drop_gpu(FT1)
        pool.drop_gpu(FT2)
