"""Pure logic: the resume iteration and the state copies after an abandoned iteration."""

from trainmover_ext.control.convergence import GridShape, plan_convergence

GRID = GridShape(tp=2, pp=2, dp=2)  # ranks: tp fastest, then dp, then pp


def test_grid_matches_megatron_order():
    assert GRID.shard_of(0) == (0, 0) and GRID.shard_of(1) == (1, 0)
    assert GRID.shard_of(2) == (0, 0) and GRID.shard_of(4) == (0, 1)
    assert GRID.replicas_of(5) == [5, 7]


def test_joiner_copies_from_its_replica():
    its = {r: 7 for r in range(8) if r != 5}
    plan = plan_convergence(GRID.rings(), its, joiners={5})
    assert plan.resume_iteration == 7 and plan.copies == [(7, 5)] and not plan.from_checkpoint


def test_replicas_that_stepped_further_bring_the_others_forward():
    # victim 5 died during the optimizer step; its replica 7 and the other DP group finished step 8
    its = {0: 7, 1: 7, 2: 8, 3: 8, 4: 7, 6: 8, 7: 8}
    plan = plan_convergence(GRID.rings(), its, joiners={5})
    assert plan.resume_iteration == 8
    assert plan.copies == [(2, 0), (3, 1), (6, 4), (7, 5)]


def test_shard_behind_everywhere_sets_k_and_ahead_ranks_copy_back():
    its = {0: 3, 2: 3, 1: 4, 3: 3, 4: 3, 6: 3, 7: 3}
    plan = plan_convergence(GRID.rings(), its, joiners={5})
    assert plan.resume_iteration == 3
    assert (3, 1) in plan.copies and (7, 5) in plan.copies


def test_no_replica_falls_back_to_checkpoint():
    grid = GridShape(tp=2, pp=2, dp=1)
    plan = plan_convergence(grid.rings(), {0: 5, 1: 5, 2: 5}, joiners={3})
    assert plan.from_checkpoint and "no live replica" in plan.reason


def test_distributed_optimizer_falls_back_to_checkpoint():
    its = {r: 7 for r in range(8) if r != 5}
    plan = plan_convergence(GRID.rings(replicas_share_state=False), its, joiners={5})
    assert plan.from_checkpoint


def test_everyone_equal_without_joiner_needs_no_copy():
    plan = plan_convergence(GRID.rings(), {r: 4 for r in range(8)}, joiners=set())
    assert plan.resume_iteration == 4 and plan.copies == []


def test_the_source_is_the_replica_nearest_in_the_data_parallel_ring():
    """DP=4: a joiner at DP index 2 copies from DP index 1 or 3 (its ring neighbours), not from DP index 0."""
    grid = GridShape(tp=2, pp=2, dp=4)  # rank = tp + 2*dp + 8*pp
    stayers = {r: 5 for r in range(16) if r != 13}  # rank 13: tp1, dp2, pp1; replicas 9, 11, 13, 15
    plan = plan_convergence(grid.rings(), stayers, {13})
    assert plan.copies == [(11, 13)]
    assert plan_convergence(grid.rings(), {r: 5 for r in range(16) if r != 15}, {15}).copies == [(9, 15)]  # wraps round
    late = {**stayers, 11: 4, 15: 4}  # only DP index 0 is at the resume iteration besides itself
    assert (9, 13) in plan_convergence(grid.rings(), late, {13}).copies


def test_grid_matches_megatron_core_in_both_rank_orders():
    """Replicas (the data-parallel groups) and stages as megatron-core lays them out, for its default order
    and for --use-tp-pp-dp-mapping (where one node of consecutive ranks holds whole pipelines)."""
    from megatron.core.parallel_state import RankGenerator

    for tp, pp, dp in ((2, 2, 2), (1, 4, 2), (2, 3, 4)):
        for pp_before_dp, order in ((False, "tp-cp-ep-dp-pp"), (True, "tp-cp-ep-pp-dp")):
            grid = GridShape(tp=tp, pp=pp, dp=dp, pp_before_dp=pp_before_dp)
            gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
            for group in gen.get_ranks("dp"):
                assert all(grid.replicas_of(r) == sorted(group) for r in group), (order, group)
            for stages in gen.get_ranks("pp"):
                assert [grid.shard_of(r)[1] for r in stages] == list(range(pp)), (order, stages)
    # the two orders differ: with tp-pp-dp, rank 2 of TP2 x PP2 x DP2 is stage 1 of replica 0
    assert GridShape(tp=2, pp=2, dp=2, pp_before_dp=True).replicas_of(5) == [1, 5]
