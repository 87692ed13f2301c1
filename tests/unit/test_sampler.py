"""BucketBatchSampler: sharding, coverage, bucket purity, world-size equivalence, mid-epoch resume."""
import logging

import pytest

from modules.data.sampler import BucketBatchSampler

# Three buckets of 23, 14 and 9 items, interleaved as an image folder would give them.
BUCKETS = [i % 3 for i in range(27)] + [0] * 14 + [1] * 5


def global_batches(buckets, batch_size, world_size, seed=7, epoch=0):
    """Reassemble the global batches from every rank's slices."""
    samplers = [BucketBatchSampler(buckets, batch_size, world_size, rank, seed) for rank in range(world_size)]
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    assert len({len(batches) for batches in per_rank}) == 1, "ranks must take the same number of steps"
    return [sum((per_rank[r][step] for r in range(world_size)), []) for step in range(len(per_rank[0]))]


def test_ranks_get_disjoint_equal_shards():
    samplers = [BucketBatchSampler(BUCKETS, 2, 3, rank, seed=1) for rank in range(3)]
    seen = [[i for batch in s for i in batch] for s in samplers]
    assert all(len(batch) == 2 for s in samplers for batch in s)
    assert not set(seen[0]) & set(seen[1]) and not set(seen[0]) & set(seen[2]) and not set(seen[1]) & set(seen[2])
    assert sum(len(x) for x in seen) == len(set().union(*map(set, seen)))


def test_coverage_except_per_bucket_remainder_and_bucket_purity():
    batches = global_batches(BUCKETS, 2, 2)  # global batch 4
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat)), "no item twice in one epoch"
    for batch in batches:
        assert len({BUCKETS[i] for i in batch}) == 1, f"mixed buckets in {batch}"
    sizes = {b: BUCKETS.count(b) for b in set(BUCKETS)}
    for bucket, size in sizes.items():
        used = sum(1 for i in flat if BUCKETS[i] == bucket)
        assert used == size // 4 * 4
    assert len(batches) == len(BucketBatchSampler(BUCKETS, 2, 2, 0)) == sum(s // 4 for s in sizes.values())


def test_deterministic_across_instances_and_reshuffled_per_epoch():
    assert global_batches(BUCKETS, 3, 1, seed=5) == global_batches(BUCKETS, 3, 1, seed=5)
    assert global_batches(BUCKETS, 3, 1, seed=5, epoch=0) != global_batches(BUCKETS, 3, 1, seed=5, epoch=1)
    assert global_batches(BUCKETS, 3, 1, seed=5) != global_batches(BUCKETS, 3, 1, seed=6)
    # The left-out remainder differs between epochs too.
    left_out = []
    for epoch in range(2):
        flat = {i for b in global_batches(BUCKETS, 3, 1, seed=5, epoch=epoch) for i in b}
        left_out.append(set(range(len(BUCKETS))) - flat)
    assert left_out[0] != left_out[1]


def test_set_epoch_gives_same_order_on_every_rank():
    a, b = BucketBatchSampler(BUCKETS, 2, 2, 0, seed=3), BucketBatchSampler(BUCKETS, 2, 2, 1, seed=3)
    a.set_epoch(4)
    b.set_epoch(4)
    assert a.global_batches() == b.global_batches()


@pytest.mark.parametrize("batch_size,world_size", [(2, 2), (1, 4), (4, 1)])
def test_world_size_does_not_change_global_batches(batch_size, world_size):
    reference = global_batches(BUCKETS, 4, 1, seed=11, epoch=2)
    assert global_batches(BUCKETS, batch_size, world_size, seed=11, epoch=2) == reference


def test_rank_takes_its_contiguous_slice():
    sampler = BucketBatchSampler(BUCKETS, 2, 2, 1, seed=0)
    for slice_, batch in zip(sampler, sampler.global_batches()):
        assert slice_ == batch[2:4]


def test_resume_mid_epoch_continues_the_uninterrupted_sequence():
    full = global_batches(BUCKETS, 2, 2, seed=9, epoch=1)
    first = BucketBatchSampler(BUCKETS, 2, 2, 0, seed=9)
    first.set_epoch(1)
    iterator = iter(first)
    for _ in range(5):  # a prefetching loader pulls ahead; only marked batches count
        next(iterator)
    first.mark_consumed(3)
    state = first.state_dict()
    assert state["consumed_batches"] == 3 and state["global_batch_size"] == 4 and state["epoch"] == 1

    resumed = [BucketBatchSampler(BUCKETS, 2, 2, rank, seed=12345) for rank in range(2)]
    for s in resumed:
        s.load_state_dict(state)
        s.set_epoch(1)  # the trainer's loop sets the epoch again; the position must survive it
    rest = [sum(pair, []) for pair in zip(*(list(s) for s in resumed))]
    assert rest == full[3:]
    resumed[0].set_epoch(2)
    assert resumed[0].consumed_batches == 0 and resumed[0].global_batches() == global_batches(BUCKETS, 2, 2, 9, 2)


@pytest.mark.parametrize("new_batch,new_world", [(3, 1), (1, 2), (2, 3)])
def test_resume_with_other_world_size_covers_exactly_the_rest(new_batch, new_world):
    old = BucketBatchSampler(BUCKETS, 2, 2, 0, seed=4)  # global batch 4
    old_batches = old.global_batches()
    old.mark_consumed(4)
    consumed = {i for b in old_batches[:4] for i in b}

    samplers = [BucketBatchSampler(BUCKETS, new_batch, new_world, r, seed=4) for r in range(new_world)]
    for s in samplers:
        s.load_state_dict(old.state_dict())
    rest = samplers[0].global_batches()
    new_global = new_batch * new_world
    flat = [i for b in rest for i in b]
    assert not consumed & set(flat), "an item consumed before the resume came back in the same epoch"
    assert len(flat) == len(set(flat))
    assert all(len(b) == new_global and len({BUCKETS[i] for i in b}) == 1 for b in rest)
    # Exactly the remaining items, minus each bucket's new remainder.
    for bucket in set(BUCKETS):
        left = [i for i in range(len(BUCKETS)) if BUCKETS[i] == bucket and i not in consumed]
        assert sum(1 for i in flat if BUCKETS[i] == bucket) == len(left) // new_global * new_global
    # Rank slices add up to the regrouped batches.
    slices = [list(s) for s in samplers]
    assert [sum((slices[r][k] for r in range(new_world)), []) for k in range(len(rest))] == rest

    # A second resume (back to the first world size) keeps the whole history.
    samplers[0].mark_consumed(1)
    consumed |= set(rest[0])
    again = BucketBatchSampler(BUCKETS, 2, 2, 0, seed=4)
    again.load_state_dict(samplers[0].state_dict())
    assert not consumed & {i for b in again.global_batches() for i in b}


def test_changed_dataset_restarts_the_epoch(caplog):
    old = BucketBatchSampler(BUCKETS, 2, 1, 0, seed=4)
    old.mark_consumed(2)
    new = BucketBatchSampler(BUCKETS + [2, 2], 2, 1, 0, seed=4)
    with caplog.at_level(logging.WARNING):
        new.load_state_dict(old.state_dict())
    assert new.consumed_batches == 0 and "dataset changed" in caplog.text


def test_mark_consumed_past_the_epoch_is_an_error():
    sampler = BucketBatchSampler([0] * 8, 4)
    sampler.mark_consumed(2)
    with pytest.raises(ValueError, match="set_epoch"):
        sampler.mark_consumed(1)


def test_zero_global_batches_error_names_the_numbers_and_the_fix():
    with pytest.raises(ValueError) as err:
        BucketBatchSampler([0] * 5 + [1] * 3, batch_size=4, world_size=2)
    message = str(err.value)
    assert "8 items" in message and "bucket 0: 5" in message and "bucket 1: 3" in message
    assert "= 8" in message and "fewer GPUs" in message and "repeats" in message


def test_unshuffled_order_is_bucket_then_position():
    sampler = BucketBatchSampler([1, 0, 1, 0, 1, 0], 2, shuffle=False)
    assert list(sampler) == [[1, 3], [0, 2]]
