"""The garbage collector held off around syncs (pure)."""

from __future__ import annotations

import gc

from proxyd import gc_pause


def test_the_collector_is_held_off_and_left_as_it_was() -> None:
    assert gc.isenabled()
    with gc_pause.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_pause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "a collector turned off stays off"
    finally:
        gc.enable()


def test_overlapping_pauses_hold_it_off_until_the_last_ends() -> None:
    listing, sync = gc_pause.paused(), gc_pause.paused()
    listing.__enter__()
    try:
        sync.__enter__()
    finally:
        listing.__exit__(None, None, None)
    try:
        assert not gc.isenabled(), "the sync that began during the list still runs without it"
    finally:
        sync.__exit__(None, None, None)
    assert gc.isenabled()
