"""The garbage collector held off around syncs (pure)."""

from __future__ import annotations

import gc
import threading

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


def test_the_put_off_collection_is_left_to_the_collector_while_another_pause_lasts() -> None:
    generations: list[int] = []
    this_thread = threading.get_ident()

    def started(phase: str, info: dict[str, int]) -> None:
        # only this thread's collections: a thread an earlier test left may collect
        if phase == "start" and threading.get_ident() == this_thread:
            generations.append(info["generation"])

    gc.callbacks.append(started)
    try:
        with gc_pause.paused():
            # the collector ran freely until the pause began: a collection then is not ours
            generations.clear()
            gc_pause.collect_deferred()
            assert generations == [], "another sync is held off from the collector: none now"
        gc_pause.collect_deferred()
        assert 2 in generations
    finally:
        gc.callbacks.remove(started)
