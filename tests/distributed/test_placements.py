"""Every op of the registry declares the DTensor layouts it takes, and apply's decision refuses every other
layout with a reason naming the op, the layout and what the op takes (a table over the registry, so a new
op cannot escape).  The real refusals on parallelised models: test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from patchdsl.distributed import PLACEMENTS, SiteLayout, placement_reason
from patchdsl.distributed.layout import OTHER
from patchdsl.ops.base import Op
from patchdsl.ops.registry import ops

ALL = sorted(PLACEMENTS) + [OTHER]


def test_every_op_declares_the_layouts_it_takes():
    for op in ops().values():
        assert isinstance(op.placements, tuple), f"{op.name} declares no placements (Op.placements)"
        assert set(op.placements) <= set(PLACEMENTS), (op.name, op.placements)
    assert Op.placements is None                  # the base declares nothing: each op must


@pytest.mark.parametrize("layout", ALL)
def test_apply_takes_a_layout_only_where_the_op_declares_it(layout):
    for op in ops().values():
        site = SiteLayout(layout, 2, "weight Shard(0)")
        why = placement_reason(op, site, op.default_flags())
        if layout in op.placements:
            assert why is None, (op.name, why)
        else:
            assert why and op.name in why and f"{layout} over 2 ranks (weight Shard(0))" in why, (op.name, why)
            takes = ", ".join(op.placements) if op.placements else "no DTensor parameters"
            assert takes in why, (op.name, why)


def test_a_layout_with_a_problem_is_refused_even_by_an_op_that_takes_it():
    op = next(o for o in ops().values() if "heads" in o.placements)
    why = placement_reason(op, SiteLayout("heads", 4, "q_proj.weight Shard(0)", problem="this rank holds 24 rows of "
                                          "q_proj, not whole heads of 16"), op.default_flags())
    assert why and "not whole heads of 16" in why


def test_flags_that_do_not_go_with_a_layout_are_refused():
    op = next(o for o in ops().values() if o.name == "fused_linear_cross_entropy")
    flags = {**op.default_flags(), "reduction": "none"}
    why = placement_reason(op, SiteLayout("vocab", 2, "weight Shard(0)"), flags)
    assert why and "reduction=none is not vocabulary-parallel" in why
    assert placement_reason(op, SiteLayout("vocab", 2, "weight Shard(0)"), op.default_flags()) is None


@pytest.mark.parametrize("args,words", [
    (["verify", "llama", "-m", "meta-llama/Llama-3.2-1B", "--tp", "3", "--tp-layout", "fsdp_tp"],
     ["fsdp_tp needs an even number of processes"]),
    (["verify", "no_such_spec_here", "-m", "meta-llama/Llama-3.2-1B", "--tp", "2"], ["no_such_spec_here"]),
    (["verify", "llama", "-m", "meta-llama/Llama-3.2-1B", "--tp", "1"], ["--tp"]),
])
def test_verify_tp_refuses_bad_input_before_any_process_starts(args, words):
    from click.testing import CliRunner

    from patchdsl.cli import main

    out = CliRunner().invoke(main, args)
    assert out.exit_code == 2, out.output
    for w in words:
        assert w in out.output
