"""Fixtures shared by the speculative decoding tests, taken in by each module that uses them.

Not a conftest: test_tree.py takes test_speculative's fixtures from that module by name, so they
stay attributes of it; and each module keeps its own prompt lengths, which set the cache and
prefill sizes its engines compile for.
"""

import pytest


@pytest.fixture(scope="module")
def target(speculation_target):
    return speculation_target


def prompts_fixture(lengths: tuple[int, ...]):
    """A module-scoped `prompts` fixture: one random prompt per length (conftest's `random_prompts`)."""

    @pytest.fixture(scope="module", name="prompts")
    def prompts(random_prompts):
        return random_prompts(lengths)

    return prompts
