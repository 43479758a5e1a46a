"""The render plan's transitions (engine/plan.jac): its clone."""

from __future__ import annotations

import copy

from contextrender import Engine
from tests.test_stability import replay, session


def test_a_clone_is_copy_copy_s_copy_with_its_containers_copied(tmp_path, monkeypatch):
    """`RenderPlan.clone` copies the plan, its layout and its choice as `copy.copy` copies them
    (the same class, every attribute in its order) with each list, dict and set copied and the
    rest shared, without going through `copy.copy` (its reduce protocol took most of a clone's
    time, and a partial re-render clones its plan a dozen times)."""
    from engine.plan import RenderPlan

    (clone, plans) = (RenderPlan.clone, [])
    monkeypatch.setattr(RenderPlan, "clone", lambda plan: plans.append(plan) or clone(plan))
    replay(Engine(tmp_path / "s"), session(30), 1200)
    assert len(plans) > 10
    copies = []
    monkeypatch.setattr(copy, "copy", lambda value, made=copy.copy: copies.append(value) or made(value))
    for plan in plans[:: max(1, len(plans) // 20)]:
        made = clone(plan)
        for (original, copied) in ((plan, made), (plan.layout, made.layout), (plan.choice, made.choice)):
            assert type(copied) is type(original) and copied is not original
            assert list(vars(copied)) == list(vars(original))
            for (name, value) in vars(original).items():
                if name in ("layout", "choice"):
                    continue
                if isinstance(value, (list, dict, set)):
                    assert getattr(copied, name) == value
                    assert getattr(copied, name) is not value and type(getattr(copied, name)) is type(value)
                else:
                    assert getattr(copied, name) is value
    assert copies == []
