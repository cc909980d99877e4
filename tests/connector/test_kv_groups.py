"""The per-group rules in isolation: what a hit of P tokens needs from each
kind of KV cache group, a coarser group's hashes, and the parts' names."""

from __future__ import annotations

from pegaflow.connector.kv_groups import GroupRule, KVGroups, single_group


def test_what_each_kind_needs_at_a_hit() -> None:
    full = GroupRule(0, "full", 16, 0, ())
    window = GroupRule(1, "sliding", 16, 127, ())  # window 128
    chunked = GroupRule(2, "chunked", 16, 64, ())
    state = GroupRule(3, "mamba", 16, 0, ())
    assert full.first_needed_token(160) == 0
    # vLLM's skipped tokens: P - window + 1; blocks below are null.
    assert window.first_needed_token(160) == 33
    assert window.first_needed_token(96) == 0
    assert chunked.first_needed_token(160) == 128  # the chunk P is in
    assert chunked.first_needed_token(128) == 128  # a new chunk: nothing
    assert state.first_needed_token(160) == 144  # one block: the state at P
    assert [r.volatile for r in (full, window, chunked, state)] == [
        False,
        True,
        True,
        True,
    ]
    assert [r.sparse for r in (full, window, chunked, state)] == [
        False,
        False,
        False,
        True,
    ]


def test_a_coarser_group_is_named_by_its_last_hash() -> None:
    fine = GroupRule(0, "full", 16, 0, ())
    coarse = GroupRule(1, "mamba", 64, 0, ())
    groups = KVGroups((fine, coarse), 16, 64)
    hashes = [bytes([i]) for i in range(10)]
    assert groups.hashes(fine, hashes) == hashes
    # A 64-token block is 4 hash blocks; the chained hash of the 4th names
    # the whole prefix.
    assert groups.hashes(coarse, hashes) == [bytes([3]), bytes([7])]


def test_part_names() -> None:
    one = single_group(16)
    (rule,) = one.rules
    assert one.part_instance("e", rule) == "e"  # unchanged for plain models
    assert one.part_instance("e", rule, 1, 2) == "e-pp1"
    two = KVGroups((rule, GroupRule(3, "sliding", 16, 31, ())), 16, 16)
    assert two.part_instance("e", two.rules[1]) == "e-g3"
    assert two.part_instance("e", two.rules[1], 0, 2) == "e-pp0-g3"


def test_groups_vllm_keeps_out_of_transfer_still_count() -> None:
    """HiSparse: one transferred group of vLLM's four is not a hybrid part
    name, but vLLM's block ids are per group all the same."""
    (rule,) = single_group(16).rules
    alone = KVGroups((rule,), 16, 16)
    beside_others = KVGroups((rule,), 16, 16, vllm_groups=4)
    assert not alone.several and not beside_others.hybrid
    assert beside_others.several
    assert beside_others.part_instance("e", rule) == "e"
