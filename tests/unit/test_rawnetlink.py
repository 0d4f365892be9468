"""Netlink attributes as rawnetlink writes and reads them: padded to four bytes, nested ones
flagged, and read back by type with the flags left out."""

from __future__ import annotations

from proxyd.rawnetlink import NESTED, attribute, attributes


def test_an_attribute_is_padded_to_four_bytes() -> None:
    assert attribute(3, b"\x11") == b"\x05\x00\x03\x00\x11\x00\x00\x00"
    assert attribute(1, b"abcd") == b"\x08\x00\x01\x00abcd"


def test_nested_attributes_are_flagged_and_read_back_by_type() -> None:
    inner = attribute(1, b"\x11") + attribute(3, b"\x00\x35")
    outer = attribute(2, inner, nested=True) + attribute(12, b"\x00\x00\x00\x07")
    assert outer[2:4] == (2 | NESTED).to_bytes(2, "little")
    found = attributes(memoryview(outer))
    assert set(found) == {2, 12}
    assert bytes(found[12]) == b"\x00\x00\x00\x07"
    nested = attributes(found[2])
    assert bytes(nested[1]) == b"\x11" and bytes(nested[3]) == b"\x00\x35"


def test_a_truncated_run_stops_at_the_last_whole_attribute() -> None:
    for tail in (b"\x02\x00", b"\x08\x00\x02\x00ab"):
        assert list(attributes(memoryview(attribute(1, b"abcd") + tail))) == [1]
