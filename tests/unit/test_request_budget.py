"""RequestBytesBudget: large request bodies worked on at once (issue 30 #4)."""

from __future__ import annotations

from pegaflow.common.errors import Overloaded
from pegaflow.common.request_limits import RequestBytesBudget

MiB = 1 << 20


def test_a_lone_body_passes_and_more_are_refused_naming_the_flag() -> None:
    budget = RequestBytesBudget(10 * MiB)
    assert budget.take(12 * MiB) is None  # alone: passes whatever its size
    refused = budget.take(1 * MiB)
    assert isinstance(refused, Overloaded)
    assert "--max-request-bytes-in-flight" in str(refused)
    assert str(10 * MiB) in str(refused)
    budget.give(12 * MiB)
    assert budget.used == 0


def test_bodies_within_the_limit_share_it() -> None:
    budget = RequestBytesBudget(10 * MiB)
    assert budget.take(4 * MiB) is None
    assert budget.take(6 * MiB) is None  # exactly the limit
    assert budget.take(1) is not None
    budget.give(6 * MiB)
    assert budget.take(5 * MiB) is None
    assert budget.used == 9 * MiB
