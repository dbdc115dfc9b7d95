"""LocalAgreement-2 (pure)."""

from __future__ import annotations

from engines.agreement import LocalAgreement, common_prefix


def test_common_prefix_ignores_case_and_punctuation() -> None:
    assert common_prefix(["The", "cat,"], ["the", "cat", "sat"]) == 2
    assert common_prefix(["a", "b"], ["a", "c"]) == 1
    assert common_prefix([], ["a"]) == 0


def test_a_word_is_committed_once_two_hypotheses_agree_and_never_the_last() -> None:
    la = LocalAgreement()
    assert la.update(["there"]) == 0
    assert la.update(["there", "is"]) == 1  # "there" agreed, "is" is the last word
    assert la.update(["there", "is", "a"]) == 2
    assert la.update(["there", "is", "a", "lot"]) == 3


def test_a_changed_word_is_not_committed_until_it_settles() -> None:
    la = LocalAgreement()
    la.update(["there", "is", "a", "lot", "on"])
    assert la.update(["there", "is", "a", "lot", "of", "traffic"]) == 4
    assert la.update(["there", "is", "a", "lot", "of", "traffic", "on"]) == 6


def test_committed_words_stay_committed() -> None:
    la = LocalAgreement()
    la.update(["a", "b", "c"])
    assert la.update(["a", "b", "c", "d"]) == 3
    # a hypothesis that disagrees later does not take committed words back
    assert la.update(["a", "b", "c", "x", "y"]) == 3


def test_eligible_caps_what_is_committed_near_the_audio_edge() -> None:
    la = LocalAgreement()
    la.update(["a", "b", "c", "d"])
    assert la.update(["a", "b", "c", "d", "e"], eligible=2) == 2
    assert la.update(["a", "b", "c", "d", "e"], eligible=5) == 4
    la.reset()
    assert la.committed == 0
    assert la.update(["z"]) == 0
