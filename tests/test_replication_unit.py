"""Replication: the pure recovery planner, checksums and bucket layouts, and gloo transfers on 4 ranks."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks

from ckless_lightning.replication import (
    BucketLayout,
    RankReport,
    Transfer,
    TransferError,
    buddy_rank,
    buddy_sources,
    buddy_survives_node_loss,
    checksum,
    default_buddy_offset,
    hsdp_sources,
    transfer_bytes,
    transfer_tensors,
)

# ---------------------------------------------------------------- planner: HSDP


def _hsdp_reports(world: int, step: int, lost: set[int], steps: dict[int, int] | None = None):
    steps = steps or {}
    return {r: RankReport(r, None if r in lost else steps.get(r, step)) for r in range(world)}


def test_hsdp_nothing_lost():
    plan = hsdp_sources(_hsdp_reports(4, 7, set()), replicate=2, shard=2)
    assert (plan.step, plan.transfers, plan.rollback, plan.lost) == (7, (), frozenset(), ())


def test_hsdp_one_lost_restores_from_peer():
    plan = hsdp_sources(_hsdp_reports(4, 7, {1}), replicate=2, shard=2)
    assert plan.step == 7
    assert plan.transfers == (Transfer(3, 1),)
    assert plan.lost == (1,) and plan.rollback == frozenset()
    assert "rank 1" in plan.reason and "step 7" in plan.reason


def test_hsdp_two_lost_in_different_replicas_and_shards():
    plan = hsdp_sources(_hsdp_reports(4, 7, {0, 3}), replicate=2, shard=2)
    assert plan.step == 7
    assert set(plan.transfers) == {Transfer(2, 0), Transfer(1, 3)}
    assert plan.lost == (0, 3)


def test_hsdp_replica_pair_both_lost_falls_back():
    plan = hsdp_sources(_hsdp_reports(4, 7, {1, 3}), replicate=2, shard=2)
    assert plan.step is None and plan.fallback
    assert plan.transfers == () and plan.rollback == frozenset()
    assert plan.lost == (1, 3)
    assert "shard 1" in plan.reason and "ranks 1, 3 both lost" in plan.reason
    assert "disk checkpoint" in plan.reason


def test_hsdp_survivors_disagree_falls_back():
    plan = hsdp_sources(_hsdp_reports(4, 7, {1}, steps={2: 6}), replicate=2, shard=2)
    assert plan.step is None
    assert "disagree" in plan.reason


def test_hsdp_no_survivor_falls_back():
    plan = hsdp_sources(_hsdp_reports(4, 7, {0, 1, 2, 3}), replicate=2, shard=2)
    assert plan.step is None and plan.lost == (0, 1, 2, 3)


def test_hsdp_missing_report_counts_as_lost():
    reports = _hsdp_reports(4, 7, set())
    del reports[2]
    plan = hsdp_sources(reports, replicate=2, shard=2)
    assert plan.transfers == (Transfer(0, 2),)


def test_hsdp_exclude_picks_next_source_then_falls_back():
    reports = _hsdp_reports(6, 7, {2})  # replicate=3, shard=2: shard 0 is ranks 0, 2, 4
    assert hsdp_sources(reports, replicate=3, shard=2).transfers == (Transfer(0, 2),)
    plan = hsdp_sources(reports, replicate=3, shard=2, exclude=frozenset({Transfer(0, 2)}))
    assert plan.step == 7 and plan.transfers == (Transfer(4, 2),)
    plan = hsdp_sources(reports, replicate=3, shard=2, exclude=frozenset({Transfer(0, 2), Transfer(4, 2)}))
    assert plan.step is None
    assert "shard 0" in plan.reason and "rejected" in plan.reason


# ---------------------------------------------------------------- planner: buddy


def _buddy(world: int = 4, offset: int = 1):
    return lambda r: buddy_rank(r, world_size=world, offset=offset)


def test_buddy_nothing_lost():
    reports = {r: RankReport(r, 7, frozenset({6, 7})) for r in range(4)}
    plan = buddy_sources(reports, buddy_of=_buddy())
    assert (plan.step, plan.transfers, plan.rollback, plan.lost) == (7, (), frozenset(), ())


def test_buddy_lost_rank_restored_at_live_step():
    reports = {r: RankReport(r, 7, frozenset({6, 7}), {(r - 1) % 4: frozenset({6, 7})}) for r in range(4)}
    reports[1] = RankReport(1, None)
    plan = buddy_sources(reports, buddy_of=_buddy())
    assert plan.step == 7
    assert plan.transfers == (Transfer(2, 1),)
    assert plan.rollback == frozenset() and plan.lost == (1,)


def test_buddy_only_older_copy_rolls_survivors_back():
    reports = {r: RankReport(r, 7, frozenset({6, 7}), {(r - 1) % 4: frozenset({6, 7})}) for r in range(4)}
    reports[1] = RankReport(1, None)
    reports[2] = RankReport(2, 7, frozenset({6, 7}), {1: frozenset({6})})  # its copy of 7 was incomplete
    plan = buddy_sources(reports, buddy_of=_buddy())
    assert plan.step == 6
    assert plan.transfers == (Transfer(2, 1),)
    assert plan.rollback == frozenset({0, 2, 3})
    assert "roll back" in plan.reason
    # One survivor without its own snapshot of 6: no step is feasible.
    reports[3] = RankReport(3, 7, frozenset({7}), {2: frozenset({6, 7})})
    plan = buddy_sources(reports, buddy_of=_buddy())
    assert plan.step is None and plan.rollback == frozenset() and plan.transfers == ()


def test_buddy_survivors_disagree_converge_on_a_snapshot():
    reports = {r: RankReport(r, 7, frozenset({7})) for r in range(4)}
    reports[0] = RankReport(0, 8, frozenset({7}))
    plan = buddy_sources(reports, buddy_of=_buddy())
    assert plan.step == 7 and plan.rollback == frozenset({0}) and plan.transfers == ()


def test_buddy_rank_and_buddy_both_lost_falls_back():
    reports = {r: RankReport(r, 7, frozenset({7}), {(r - 1) % 4: frozenset({7})}) for r in range(4)}
    reports[1] = RankReport(1, None)
    reports[2] = RankReport(2, None)
    plan = buddy_sources(reports, buddy_of=_buddy())
    assert plan.step is None and plan.lost == (1, 2)
    assert "rank 1 and its buddy rank 2 both lost" in plan.reason


def test_buddy_exclude_falls_back():
    reports = {r: RankReport(r, 7, frozenset({7}), {(r - 1) % 4: frozenset({7})}) for r in range(4)}
    reports[1] = RankReport(1, None)
    plan = buddy_sources(reports, buddy_of=_buddy(), exclude=frozenset({Transfer(2, 1)}))
    assert plan.step is None and "rejected" in plan.reason


def test_buddy_helpers():
    assert default_buddy_offset(2, 4) == 4
    assert default_buddy_offset(1, 4) == 1
    assert buddy_rank(3, world_size=4, offset=2) == 1
    assert buddy_survives_node_loss(2, 2, 2)
    assert not buddy_survives_node_loss(1, 2, 2)
    assert not buddy_survives_node_loss(4, 2, 2)  # offset % world == 0: a rank is its own buddy
    assert not buddy_survives_node_loss(1, 1, 4)
    assert buddy_survives_node_loss(default_buddy_offset(3, 8), 3, 8)


def test_rank_report_hashable():
    with_held = RankReport(0, 1, frozenset({1}), {1: frozenset({1})})
    assert hash(with_held) == hash(RankReport(0, 1, frozenset({1})))


# ---------------------------------------------------------------- checksum and layout


def test_checksum_detects_flipped_byte_and_swapped_words():
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ref = checksum(buf)
    assert ref.dtype == torch.int64 and ref.shape == (2,)
    assert torch.equal(checksum(buf.clone()), ref)
    flipped = buf.clone()
    flipped[1234] ^= 0x10
    assert not torch.equal(checksum(flipped), ref)
    words = buf.clone().view(torch.int64)
    words[[3, 40]] = words[[40, 3]]
    assert words[3] != words[40]
    swapped = words.view(torch.uint8)
    assert checksum(swapped)[0] == ref[0]  # same bytes, other order: only the weighted sum sees it
    assert not torch.equal(checksum(swapped), ref)
    with pytest.raises(ValueError):
        checksum(torch.zeros(12, dtype=torch.uint8))


def _mixed_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(300, generator=g),  # 1200 B
        torch.randn(33, 7, generator=g).to(torch.bfloat16),  # 462 B, padded to 464
        torch.randint(-(2**40), 2**40, (50,), generator=g),  # int64, 400 B
        torch.tensor(float(seed) + 0.5, dtype=torch.float64),  # 0-dim
        torch.randn(2000, generator=g),  # 8000 B > bucket_bytes: a bucket of its own
        torch.randint(-100, 100, (13,), dtype=torch.int8, generator=g),
        torch.zeros(0),  # empty
        torch.randn(700, generator=g),
    ]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_bucket_layout_round_trip():
    src, dst = _mixed_tensors(1), _mixed_tensors(2)
    layout = BucketLayout(src, bucket_bytes=4096)
    assert layout.num_buckets >= 3
    big = next(i for i in range(layout.num_buckets) if 4 in layout.bucket_tensors(i))
    assert layout.bucket_tensors(big) == [4] and layout.bucket_nbytes(big) == 8000
    for i in range(layout.num_buckets):
        n = layout.bucket_nbytes(i)
        assert n % 8 == 0 and (n <= 4096 or layout.bucket_tensors(i) == [4])
    assert layout.total_bytes == sum(layout.bucket_nbytes(i) for i in range(layout.num_buckets))
    assert sorted(j for i in range(layout.num_buckets) for j in layout.bucket_tensors(i)) == list(range(8))
    assert BucketLayout(dst, bucket_bytes=4096).signature == layout.signature
    ptrs = [t.data_ptr() for t in dst]
    for i in range(layout.num_buckets):
        buf = torch.zeros(layout.bucket_nbytes(i), dtype=torch.uint8)
        layout.pack(i, src, buf)
        layout.unpack(i, buf, dst)
    assert all(_same_bits(a, b) for a, b in zip(src, dst, strict=True))
    assert [t.data_ptr() for t in dst] == ptrs


def test_bucket_layout_unpacks_into_parameters():
    param = torch.nn.Parameter(torch.zeros(10))
    layout = BucketLayout([param], bucket_bytes=4096)
    buf = torch.zeros(layout.bucket_nbytes(0), dtype=torch.uint8)
    layout.pack(0, [torch.ones(10)], buf)
    layout.unpack(0, buf, [param])
    assert torch.equal(param.detach(), torch.ones(10)) and param.requires_grad


def test_bucket_layout_rejects_non_contiguous():
    with pytest.raises(ValueError):
        BucketLayout([torch.zeros(4, 4).t()])


# ---------------------------------------------------------------- 4 gloo ranks

_BUCKET = 4096


def _flip_bucket_1_of_0_to_1(pair: Transfer, bucket: int, buf: torch.Tensor) -> None:
    if pair == Transfer(0, 1) and bucket == 1:
        buf[5] ^= 0xFF


def _flip_0_to_3(pair: Transfer, bucket: int, buf: torch.Tensor) -> None:
    if pair == Transfer(0, 3):
        buf[0] ^= 0x01


def _parallel_restore(rank: int, world_size: int) -> dict:
    out: dict = {}
    # 0 -> 1 and 2 -> 3 in parallel.
    tensors = _mixed_tensors(rank)
    ptrs = [t.data_ptr() for t in tensors]
    pairs = [Transfer(0, 1), Transfer(2, 3)]
    out["result"] = transfer_tensors(pairs, tensors, bucket_bytes=_BUCKET)
    out["same_storage"] = [t.data_ptr() for t in tensors] == ptrs
    out["tensors"] = tensors
    # One source, two receivers, and rank 2 in no pair.
    tensors = _mixed_tensors(10 + rank)
    out["fanout_result"] = transfer_tensors([Transfer(0, 1), Transfer(0, 3)], tensors, bucket_bytes=_BUCKET)
    out["fanout_tensors"] = tensors
    # A subgroup: ranks are global ranks; rank 0 is not in the group and does not call.
    group = dist.new_group([1, 2, 3])
    if rank != 0:
        tensors = _mixed_tensors(20 + rank)
        out["group_result"] = transfer_tensors([Transfer(3, 1)], tensors, group=group, bucket_bytes=_BUCKET)
        out["group_tensors"] = tensors
    # Mismatched shapes between the two ranks of a pair: every rank raises, nobody hangs.
    tensors = _mixed_tensors(rank) + ([torch.zeros(3)] if rank == 1 else [])
    try:
        transfer_tensors([Transfer(0, 1)], tensors, bucket_bytes=_BUCKET)
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_transfer_tensors_parallel_receivers():
    results = run_ranks(_parallel_restore, 4, timeout=100)
    for res in results:
        assert res["result"] == {1: True, 3: True}
        assert res["fanout_result"] == {1: True, 3: True}
        assert res["mismatch"] is not None and "differ" in res["mismatch"]
    assert all(res["same_storage"] for res in results)
    expect = {0: _mixed_tensors(0), 1: _mixed_tensors(0), 2: _mixed_tensors(2), 3: _mixed_tensors(2)}
    for rank, res in enumerate(results):
        assert all(_same_bits(a, b) for a, b in zip(res["tensors"], expect[rank], strict=True)), rank
    expect = {0: _mixed_tensors(10), 1: _mixed_tensors(10), 2: _mixed_tensors(12), 3: _mixed_tensors(10)}
    for rank, res in enumerate(results):
        assert all(_same_bits(a, b) for a, b in zip(res["fanout_tensors"], expect[rank], strict=True)), rank
    assert [res.get("group_result") for res in results] == [None] + [{1: True}] * 3
    expect = {1: _mixed_tensors(23), 2: _mixed_tensors(22), 3: _mixed_tensors(23)}
    for rank in (1, 2, 3):
        assert all(
            _same_bits(a, b) for a, b in zip(results[rank]["group_tensors"], expect[rank], strict=True)
        )


def _corrupted_restore(rank: int, world_size: int) -> dict:
    tensors = _mixed_tensors(rank)
    pairs = [Transfer(0, 1), Transfer(2, 3)]
    result = transfer_tensors(pairs, tensors, bucket_bytes=_BUCKET, corrupt=_flip_bucket_1_of_0_to_1)
    return {"result": result, "tensors": tensors}


@pytest.mark.timeout(120)
def test_transfer_tensors_corrupted_bucket_is_not_unpacked():
    results = run_ranks(_corrupted_restore, 4, timeout=100)
    assert [res["result"] for res in results] == [{1: False, 3: True}] * 4
    layout = BucketLayout(_mixed_tensors(0), bucket_bytes=_BUCKET)
    assert layout.num_buckets >= 3
    first = set(layout.bucket_tensors(0))
    sender, own = _mixed_tensors(0), _mixed_tensors(1)
    for j, t in enumerate(results[1]["tensors"]):
        expect = sender[j] if j in first else own[j]  # bucket 0 verified; bucket 1 failed, rest skipped
        assert _same_bits(t, expect), j
    assert all(_same_bits(a, b) for a, b in zip(results[3]["tensors"], _mixed_tensors(2), strict=True))
    assert all(_same_bits(a, b) for a, b in zip(results[0]["tensors"], _mixed_tensors(0), strict=True))


def _bytes_round_trip(rank: int, world_size: int) -> dict:
    payload = pickle.dumps({"global_step": 7, "epoch": 1, "rank": rank}) if rank in (0, 2) else None
    out: dict = {"plain": transfer_bytes([Transfer(0, 1), Transfer(2, 3)], payload)}
    out["empty"] = transfer_bytes([Transfer(0, 3)], b"" if rank == 0 else None)
    try:
        transfer_bytes([Transfer(0, 1), Transfer(0, 3)], payload, corrupt=_flip_0_to_3)
        out["corrupt"] = None
    except TransferError as exc:
        out["corrupt"] = exc.failed
    return out


@pytest.mark.timeout(120)
def test_transfer_bytes_round_trip_and_corruption():
    results = run_ranks(_bytes_round_trip, 4, timeout=100)
    plain = [None if r["plain"] is None else pickle.loads(r["plain"]) for r in results]
    counters = {"global_step": 7, "epoch": 1}
    assert plain == [None, {**counters, "rank": 0}, None, {**counters, "rank": 2}]
    assert [r["empty"] for r in results] == [None, None, None, b""]
    assert [r["corrupt"] for r in results] == [(Transfer(0, 3),)] * 4


def test_buddy_rank_that_raised_rolls_back_to_its_own_copy():
    """A live process whose state is untrusted (it raised mid-update) still has complete own copies:
    with its buddy lost too, the job resumes from those, not from disk (CI, mixtral tier 4)."""
    reports = {r: RankReport(r, 6, frozenset({5, 6}), {(r - 1) % 4: frozenset({5, 6})}) for r in range(4)}
    reports[2] = RankReport(2, None, frozenset({4, 5}), {1: frozenset({4, 5})})  # raised in step 6's update
    reports[3] = RankReport(3, None)  # its buddy, replaced
    plan = buddy_sources(reports, buddy_of=_buddy())
    assert plan.step == 5
    assert plan.transfers == (Transfer(0, 3),)
    assert plan.lost == (3,) and plan.rollback == frozenset({0, 1, 2})


def test_buddy_untrusted_buddy_still_serves_its_held_copy():
    reports = {r: RankReport(r, 7, frozenset({7}), {(r - 1) % 4: frozenset({7})}) for r in range(4)}
    reports[1] = RankReport(1, None)  # replaced
    reports[2] = RankReport(2, None, frozenset({7}), {1: frozenset({7})})  # its buddy raised
    plan = buddy_sources(reports, buddy_of=_buddy())
    assert plan.step == 7 and plan.transfers == (Transfer(2, 1),) and plan.rollback == frozenset({2})


def test_buddy_no_live_rank_but_copies_everywhere():
    reports = {r: RankReport(r, None, frozenset({3}), {(r - 1) % 4: frozenset({3})}) for r in range(4)}
    plan = buddy_sources(reports, buddy_of=_buddy())
    assert plan.step == 3 and plan.transfers == () and plan.rollback == frozenset(range(4))
    assert buddy_sources({r: RankReport(r, None) for r in range(4)}, buddy_of=_buddy()).reason.startswith(
        "no rank holds trusted live state"
    )


def test_params_are_optimized_rejects_a_swapped_or_stateless_parameter():
    """A live capture is only taken when the registered parameters are the optimizer's (a fault
    inside FSDP2's all-gather can leave a block's unsharded parameters registered)."""
    import torch

    from ckless_lightning.replication.state import params_are_optimized

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    assert params_are_optimized(model, [optimizer])  # no state yet: nothing to mismatch
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    assert params_are_optimized(model, [optimizer])
    optimizer.state.pop(model[1].bias)
    assert not params_are_optimized(model, [optimizer])
    optimizer.state[model[1].bias] = {}
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())  # what an unsharded view is
    assert not params_are_optimized(model, [optimizer])


def _listing_outlives_an_unshard(rank: int, world_size: int) -> tuple[bool, bool, bool, bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckless_lightning.replication import SnapshotCopies
    from ckless_lightning.replication.state import params_are_optimized
    from ckless_lightning.training.callbacks.snapshot import SnapshotCallback

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    callback = SnapshotCallback(SnapshotCopies(rank, world_size, "hsdp"))
    callback.state_tensors(model, [optimizer])  # what the snapshot after the step lists
    sharded = {name: p.to_local().data_ptr() for name, p in model.named_parameters()}
    model[0].unshard()  # what a fault inside FSDP2's all-gather can leave registered
    registered_ok = params_are_optimized(model, [optimizer])
    live = callback.live_params(model, [optimizer])
    assert live is not None
    same_storage = all(p.local.data_ptr() == sharded[p.name] for p in live)
    with_state = all(set(p.state) == {"step", "exp_avg", "exp_avg_sq"} for p in live)
    other = torch.optim.AdamW(model.parameters())
    return registered_ok, same_storage, with_state, callback.live_params(model, [other]) is None


@pytest.mark.timeout(120)
def test_snapshot_listing_outlives_unsharded_registration():
    """The live state a survivor offers is the snapshot's listing of the optimizer's sharded
    tensors, not what the module has registered when the fault hit (its unsharded parameters,
    after a fault inside an all-gather): such a rank keeps its shard (a 300M HSDP run lost both
    copies of a shard when the other replica's ranks were cut mid-step)."""
    for registered_ok, same_storage, with_state, other_is_none in run_ranks(_listing_outlives_an_unshard, 2):
        assert not registered_ok  # registration alone no longer says what the optimizer steps
        assert same_storage and with_state and other_is_none


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, foreach=True),
        lambda ps: torch.optim.Adam(ps, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),  # the generic path (a zero step)
    ],
)
def test_allocated_optimizer_state_is_shaped_like_a_first_step(make):
    """A replaced rank allocates its optimizer state for the transfer without running a step:
    the same keys, shapes, dtypes and devices as the state a real first step creates."""
    from ckless_lightning.replication.state import allocate_optimizer_state

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))

    stepped, allocated = model(), model()
    reference = make(stepped.parameters())
    stepped(torch.ones(2, 3)).sum().backward()
    reference.step()
    optimizer = make(allocated.parameters())
    allocate_optimizer_state(optimizer)
    for p_ref, p in zip(stepped.parameters(), allocated.parameters(), strict=True):
        want, got = reference.state[p_ref], optimizer.state[p]
        assert sorted(want) == sorted(got)
        for key in want:
            assert (want[key].shape, want[key].dtype, want[key].device) == (
                got[key].shape,
                got[key].dtype,
                got[key].device,
            ), key
