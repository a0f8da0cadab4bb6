"""The model of PyTorch's CUDA caching allocator in ``benchmarks/step/allocator_sim.py`` (issue 30's memory
finding rests on it) follows the allocator's documented rules: rounding, segment sizes, best fit, splitting,
merging, and what ``empty_cache`` can return."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

MIB = 2**20


@pytest.fixture(scope="module")
def sim():
    path = Path(__file__).parents[1] / "benchmarks" / "step" / "allocator_sim.py"
    spec = importlib.util.spec_from_file_location("allocator_sim", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_requests_are_rounded_and_served_from_segments_of_their_size_class(sim):
    a = sim.CachingAllocator()
    a.malloc(1, 1)  # small: 512 bytes of a 2 MiB segment
    a.malloc(3, 11 * MIB + 1)  # 10 MiB or more: its own segment, rounded to 2 MiB (the 1 MiB left is not split off)
    a.malloc(2, 5 * MIB)  # large, under 10 MiB: a 20 MiB segment, split
    assert sorted(a.segments.values()) == [2 * MIB, 12 * MIB, 20 * MIB]
    assert (a.used[1].size, a.used[2].size, a.used[3].size) == (512, 5 * MIB, 12 * MIB)
    a.malloc(4, 11 * MIB)  # any large block that fits serves: the 15 MiB left of the 20 MiB segment
    assert len(a.segments) == 3 and a.used[4].segment == a.used[2].segment


def test_best_fit_split_and_merge(sim):
    a = sim.CachingAllocator()
    for key, size in ((1, 40 * MIB), (2, 12 * MIB), (3, 64 * MIB)):
        a.malloc(key, size)
    a.release(1)
    a.release(3)
    a.malloc(4, 12 * MIB)  # the smallest free block that fits: the 40 MiB one (not the 64), split
    assert a.used[4].segment == a.used[2].segment - 1 and a.used[4].size == 12 * MIB  # segments 0, 1, 2 in order
    a.malloc(5, 27 * MIB + 512 * 1024)  # the 28 MiB left, leaving 0.5 MiB: a large block splits only above 1 MiB
    assert a.used[5].size == 28 * MIB and a.used[5].segment == a.used[4].segment
    a.release(4)
    a.release(5)  # neighbours merge back into one free block of the whole segment
    a.empty_cache()
    assert sorted(a.segments.values()) == [12 * MIB]


def test_a_live_block_keeps_its_segment_and_its_free_part_reserved(sim):
    a = sim.CachingAllocator()
    a.malloc(1, 800 * MIB)  # an activation
    a.release(1)
    a.malloc(2, 64 * MIB)  # a long-lived tensor made next lands inside it
    a.empty_cache()
    state = a.state()
    assert state["reserved_gib"] * 1024 == 800 and state["allocated_gib"] * 1024 == 64
    assert state["pinned_free_gib"] * 1024 == 736
