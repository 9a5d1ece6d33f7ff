"""make mutants' catalogue stays true to the code: a change that rewrites a mutated line must update
its mutant in the same commit, or `make mutants` would refuse to run (tests/mutants.py)."""

from collections import Counter

from mutant_catalogue import MUTANTS
from mutants import check_catalogue

PACKAGES = ("core", "distributed", "memory", "fusion", "parallel", "precision", "checkpoint", "simulate",
            "trainer")


def test_every_mutant_applies_once_to_the_code_as_it_is():
    assert check_catalogue(MUTANTS) == []


def test_every_package_has_at_least_five_mutants():
    per_package = Counter(m.file.split("/")[1] for m in MUTANTS)
    assert all(per_package[p] >= 5 for p in PACKAGES), per_package
