"""Pure logic: the resume iteration and the state copies after an abandoned iteration."""

from trainmover_ext.control.convergence import GridShape, plan_convergence, plan_mirror_convergence

GRID = GridShape(tp=2, pp=2, dp=2)  # ranks: tp fastest, then dp, then pp


def test_grid_matches_megatron_order():
    assert GRID.shard_of(0) == (0, 0, 0) and GRID.shard_of(1) == (1, 0, 0)
    assert GRID.shard_of(2) == (0, 0, 0) and GRID.shard_of(4) == (0, 1, 0)
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


def test_expert_parallel_replicas_are_megatron_cores_expert_data_parallel_groups():
    """Under EP a rank's state lives only on the data-parallel ranks with its EP rank: megatron-core's
    expert-data-parallel group (expert TP = TP), a subset of its dense data-parallel group."""
    from megatron.core.parallel_state import RankGenerator

    for tp, pp, dp, ep in ((1, 2, 4, 2), (2, 2, 4, 2), (1, 1, 8, 4), (2, 3, 4, 4), (1, 2, 4, 1)):
        grid = GridShape(tp=tp, pp=pp, dp=dp, ep=ep)
        expert = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
        groups = expert.get_ranks("dp")
        assert len(groups) == grid.world_size // (dp // ep)
        for group in groups:
            assert all(grid.replicas_of(r) == sorted(group) for r in group), ((tp, pp, dp, ep), group)
        dense = GridShape(tp=tp, pp=pp, dp=dp)
        assert all(set(grid.replicas_of(r)) <= set(dense.replicas_of(r)) for r in range(grid.world_size))
    # the companion: without its EP size the grid names a replica that holds other experts
    assert GridShape(tp=1, pp=2, dp=4).replicas_of(0) == [0, 1, 2, 3]
    assert GridShape(tp=1, pp=2, dp=4, ep=2).replicas_of(0) == [0, 2]


def test_context_parallel_replicas_are_megatron_cores_data_and_context_parallel_groups():
    """Under CP (right after TP in megatron's order) every rank of a context-parallel group holds the same
    parameters: a rank's replicas are its dp-cp group, in both rank orders; its stage is unchanged."""
    from megatron.core.parallel_state import RankGenerator

    for tp, cp, pp, dp in ((1, 2, 2, 2), (2, 2, 2, 1), (2, 4, 1, 2), (1, 2, 3, 2)):
        for pp_before_dp, order in ((False, "tp-cp-ep-dp-pp"), (True, "tp-cp-ep-pp-dp")):
            grid = GridShape(tp=tp, pp=pp, dp=dp, cp=cp, pp_before_dp=pp_before_dp)
            gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
            assert grid.world_size == tp * cp * pp * dp
            for group in gen.get_ranks("dp-cp"):
                assert all(grid.replicas_of(r) == sorted(group) for r in group), (order, group)
            for stages in gen.get_ranks("pp"):
                assert [grid.shard_of(r)[1] for r in stages] == list(range(pp)), (order, stages)
    # the companion: in the tp-pp-dp order, a grid that folds CP into DP names ranks of the other stage
    assert GridShape(tp=1, pp=2, dp=2, cp=2, pp_before_dp=True).replicas_of(0) == [0, 1, 4, 5]
    assert GridShape(tp=1, pp=2, dp=4, pp_before_dp=True).replicas_of(0) == [0, 2, 4, 6]


# --- the distributed optimizer's host-memory mirror -----------------------------------------------
# TP2 x PP2 x DP2: rank r's shard is held by its data-parallel peer (0<->2, 1<->3, 4<->6, 5<->7).
HOLDERS = {0: 2, 2: 0, 1: 3, 3: 1, 4: 6, 6: 4, 5: 7, 7: 5}


def test_mirror_a_lost_rank_takes_its_shard_from_its_holder():
    its = {r: 6 for r in HOLDERS if r != 5}
    held = {r: [5, 6] for r in its}
    plan = plan_mirror_convergence(HOLDERS, its, dict(its), held, joiners={5}, staged={r: [i] for r, i in its.items()})
    assert (plan.resume_iteration, plan.copies, plan.mirror) == (6, [(7, 5)], True)


def test_mirror_ranks_ahead_roll_back_and_a_stepped_rank_uses_its_own_copy():
    """Rank 5 died inside its step of iteration 7: its peer 7 stepped its shard in place (7) but could
    not gather, the other groups completed 7. Resume at 6: every stayer from its own staged copy of 6
    (no traffic), 5 from 7's mirror."""
    its = {0: 7, 1: 7, 2: 7, 3: 7, 4: 7, 6: 7, 7: 6}
    shards = {**its, 7: 7}
    held = {0: [6, 7], 1: [6, 7], 2: [6, 7], 3: [6, 7], 4: [6, 7], 6: [6, 7], 7: [5, 6]}
    staged = {**{r: [i - 1, i] for r, i in its.items()}, 7: [5, 6]}
    plan = plan_mirror_convergence(HOLDERS, its, shards, held, joiners={5}, staged=staged)
    assert plan.resume_iteration == 6
    assert plan.copies == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (7, 5), (6, 6), (7, 7)]
    # Without their own copies, the ranks ahead take their holders' (the same iteration, over the network).
    plan = plan_mirror_convergence(HOLDERS, its, shards, held, joiners={5}, staged={7: [5, 6]})
    assert plan.copies == [(2, 0), (3, 1), (0, 2), (1, 3), (6, 4), (7, 5), (4, 6), (7, 7)]


def test_mirror_holder_lost_with_its_ward_falls_back_to_the_checkpoint():
    its = {r: 6 for r in HOLDERS if r not in (5, 7)}
    held = {r: [5, 6] for r in its}
    staged = {r: [5, 6] for r in its}
    plan = plan_mirror_convergence(HOLDERS, its, dict(its), held, joiners={5, 7}, staged=staged)
    assert plan.from_checkpoint and not plan.copies
    assert "rank 5's holder rank 7 was lost" in plan.reason, plan.reason


def test_mirror_a_newest_copy_that_never_landed_costs_one_step():
    """Rank 5 died in its mirror copy after step 6: its holder 7 committed only 4 and 5. Every stayer
    goes back to its own copy of 5, rank 5 takes 7's: the job resumes at 5."""
    its = {r: 6 for r in HOLDERS if r != 5}
    held = {r: [5, 6] for r in its}
    held[7] = [4, 5]
    staged = {r: [5, 6] for r in its}
    plan = plan_mirror_convergence(HOLDERS, its, dict(its), held, joiners={5}, staged=staged)
    assert plan.resume_iteration == 5 and (7, 5) in plan.copies
    assert all(src == dst for src, dst in plan.copies if dst != 5)
    # With one own copy (6) rank 7 could not go back to 5 (its holder is the rank lost): the checkpoint,
    # and the reason names the copies the holder has.
    plan = plan_mirror_convergence(HOLDERS, its, dict(its), held, joiners={5}, staged={r: [6] for r in its})
    assert plan.from_checkpoint and "rank 5's holder rank 7 holds iterations [4, 5]" in plan.reason, plan.reason
