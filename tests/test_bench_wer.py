"""The benchmark's WER: normalizer and word-level edit distance."""

from __future__ import annotations

from bench.wer import corpus_wer, edit_distance, normalize, number_words, score


def test_normalizer_lowercases_strips_punctuation_and_spells_numbers() -> None:
    assert normalize("The train leaves from platform 4, at 9:30!") == \
        ["the", "train", "leaves", "from", "platform", "four", "at", "nine", "thirty"]
    assert normalize("Revenue grew by 12% - didn't it?") == \
        ["revenue", "grew", "by", "twelve", "percent", "didn't", "it"]


def test_a_range_of_numbers_reads_as_to() -> None:
    assert normalize("within 3 -5 working days") == normalize("within three to five working days")


def test_ordinals_read_as_words() -> None:
    assert normalize("on the 15th of May, the 2nd and the 21st") == normalize(
        "on the fifteenth of may the second and the twenty first")
    assert normalize("the 30th") == ["the", "thirtieth"]


def test_number_words() -> None:
    assert number_words(0) == ["zero"]
    assert number_words(45) == ["forty", "five"]
    assert number_words(1200) == ["one", "thousand", "two", "hundred"]


def test_edit_distance_counts_substitutions_deletions_insertions() -> None:
    assert edit_distance(["a", "b", "c"], ["a", "b", "c"]) == 0
    assert edit_distance(["a", "b", "c"], ["a", "x", "c"]) == 1
    assert edit_distance(["a", "b", "c"], ["a", "c"]) == 1
    assert edit_distance(["a", "b", "c"], ["a", "b", "c", "d", "e"]) == 2
    assert edit_distance(["a", "b"], []) == 2
    assert edit_distance([], ["a"]) == 1


def test_score_and_corpus_wer_weigh_by_reference_words() -> None:
    assert score("Hello, world.", "hello world").wer == 0.0
    assert score("one two three four", "one too three").wer == 0.5
    # 1 error in 4 words and 0 in 1: 1/5, not the mean of 0.25 and 0
    assert corpus_wer([("a b c d", "a b c"), ("e", "e")]) == 0.2
    assert corpus_wer([]) is None
