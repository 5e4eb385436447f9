"""What the core fuzzer found (fuzz/), each as a plain test that failed before its fix."""

from __future__ import annotations

import pytest

pytest.importorskip("kvindex.index._core", reason="the compiled core is not built")

from kvindex.index import PureFleetIndex  # noqa: E402
from kvindex.index.compiled import CompiledIndex  # noqa: E402
from kvindex.subscriber import SourceKey  # noqa: E402
from kvindex.wire import BlockRemoved, BlockStored, WireError  # noqa: E402
from kvindex.wire.publisher import encode_batch  # noqa: E402


def test_a_refused_payload_registers_no_publisher() -> None:
    """A payload that is no batch at all, from a publisher never heard of: both refuse it
    and neither lists the publisher (the compiled index kept it, empty, in every answer)."""
    for index in (PureFleetIndex(), CompiledIndex(seed=1)):
        with pytest.raises(WireError):
            index.apply_payload(SourceKey("b"), b"\x92")
        assert index.instances() == [] and index.lookup([1, 2, 3, 4]) == []


@pytest.mark.parametrize("group", [2**31, 2**32, 2**40 + 3, -(2**31) - 1, -(2**62)])
def test_a_group_past_32_bits_is_its_own_pool(group: int) -> None:
    """group_idx is any int on the wire: the core kept it as int32, so 2^32 became group 0
    and every event made one more pool of it (stores doubled, removals missed)."""
    stored = encode_batch([BlockStored([7], None, [1, 2, 3, 4], 4, group_idx=group)], 1.0, 0)
    removed = encode_batch([BlockRemoved([7], group_idx=group)], 2.0, 0)
    for index in (PureFleetIndex(), CompiledIndex(seed=1)):
        index.apply_payload(SourceKey("a"), stored)
        index.apply_payload(SourceKey("a"), stored)
        assert index.copies(SourceKey("a")) == {(group, "GPU"): {7: 2}}
        index.apply_payload(SourceKey("b"), stored)
        index.apply_payload(SourceKey("b"), removed)
        assert index.copies(SourceKey("b")) == {(group, "GPU"): {}}
