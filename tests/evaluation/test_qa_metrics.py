"""Hand-computed cases for inferscale.evaluation.qa_metrics (SQuAD F1, LoCoMo F1, gold-token recall,
BLEU-1)."""

import math

import pytest

from inferscale.evaluation.qa_metrics import (
    aggregate,
    bleu1,
    gold_recall,
    locomo_f1,
    normalize_answer,
    token_f1,
    tokens,
)


def test_normalize_answer():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert normalize_answer(2022) == "2022"
    assert normalize_answer("  ") == ""


def test_exact_match():
    assert token_f1("Paris", "paris.") == 1.0
    assert bleu1("Paris", "paris.") == 1.0


def test_partial_overlap():
    # pred "the cat sat on the mat" -> [cat, sat, on, mat] (4 tokens)
    # gold "a cat on a mat"         -> [cat, on, mat]      (3 tokens)
    # overlap 3: P = 3/4, R = 3/3 = 1, F1 = 2 * 0.75 * 1 / 1.75 = 6/7
    assert token_f1("the cat sat on the mat", "a cat on a mat") == pytest.approx(6 / 7)
    # BLEU-1: clipped precision 3/4; c = 4 > r = 3, so BP = 1 -> 0.75
    assert bleu1("the cat sat on the mat", "a cat on a mat") == pytest.approx(0.75)


def test_no_overlap():
    assert token_f1("dog", "cat") == 0.0
    assert bleu1("dog", "cat") == 0.0


def test_empty():
    assert token_f1("", "") == 1.0
    assert token_f1("the", "a") == 1.0  # both empty after normalisation
    assert token_f1("", "cat") == 0.0
    assert token_f1("cat", "") == 0.0
    assert bleu1("", "cat") == 0.0
    assert bleu1("", "") == 0.0  # empty prediction scores 0


def test_integer_like_answers():
    assert token_f1("2022", "2022.") == 1.0
    assert token_f1(2022, "2022") == 1.0
    assert bleu1("In 2022.", 2022) == pytest.approx(0.5)  # [in, 2022] vs [2022]: P = 1/2, c > r, BP = 1


def test_bleu1_brevity_penalty():
    # pred [cat] vs gold [cat, on, mat]: precision 1/1 = 1; c = 1 <= r = 3,
    # BP = exp(1 - r/c) = exp(1 - 3) = exp(-2) ~ 0.1353 -> BLEU-1 = exp(-2)
    assert bleu1("cat", "a cat on a mat") == pytest.approx(math.exp(-2))
    # F1 for the same: P = 1, R = 1/3, F1 = 2 * (1/3) / (4/3) = 0.5
    assert token_f1("cat", "a cat on a mat") == pytest.approx(0.5)
    # equal lengths: c = r = 3 -> BP = exp(0) = 1; clipping: "cat" counts once -> 1/3
    assert bleu1("cat cat cat", "cat on mat") == pytest.approx(1 / 3)


def test_tokens():
    assert tokens("The cat's hat") == ["cats", "hat"]


def test_aggregate():
    rows = [{"category": 1, "f1": 1.0, "bleu1": 0.5}, {"category": 1, "f1": 0.0, "bleu1": 0.5},
            {"category": 2, "f1": 0.5, "bleu1": None}]
    agg = aggregate(rows, "category")
    assert list(agg) == [1, 2]
    assert agg[1] == {"n": 2, "f1": 0.5, "bleu1": 0.5}
    assert agg[2]["n"] == 1 and agg[2]["f1"] == 0.5 and math.isnan(agg[2]["bleu1"])
    assert aggregate(rows, lambda r: "all")["all"]["f1"] == pytest.approx(0.5)


def test_locomo_f1_stems_and_drops_and():
    pytest.importorskip("nltk")
    # "Running marathons" -> [run, marathon]; "ran the marathon" -> [ran, marathon]: 1 of 2 each way
    assert locomo_f1("Running marathons", "ran the marathon", 2) == pytest.approx(0.5)
    # SQuAD F1 sees no overlap at all without stemming
    assert token_f1("Running marathons", "ran the marathon") == 0.0
    # "and" and commas are dropped: [7, may, 2023] both sides
    assert locomo_f1("7 May and 2023", "7 May, 2023", 4) == 1.0
    assert locomo_f1(2022, 2022, 2) == 1.0  # integer answers


def test_locomo_f1_multi_hop_matches_each_gold_part():
    pytest.importorskip("nltk")
    # gold parts [run] and [paint, swim]; predicted parts [run] and [swim]
    # part 1: best F1 1; part 2: best F1 with [swim]: P = 1, R = 1/2 -> 2/3; mean (1 + 2/3) / 2 = 5/6
    assert locomo_f1("Running, swimming", "running, painting and swimming", 1) == pytest.approx(5 / 6)
    # not split for other categories: [run, swim] vs [run, paint, swim] -> P = 1, R = 2/3 -> 0.8
    assert locomo_f1("Running, swimming", "running, painting and swimming", 4) == pytest.approx(0.8)


def test_locomo_f1_open_domain_and_adversarial():
    pytest.importorskip("nltk")
    assert locomo_f1("Paris", "Paris; France", 3) == 1.0  # first alternative only
    assert locomo_f1("France", "Paris; France", 3) == 0.0
    assert locomo_f1("That is not mentioned in the conversation.", "x", 5) == 1.0
    assert locomo_f1("Paris", "x", 5) == 0.0
    with pytest.raises(ValueError, match="category"):
        locomo_f1("a", "b", 6)


def test_gold_recall_counts_the_gold_answer_s_words_not_the_wording():
    pytest.importorskip("nltk")
    # the example: both right, F1 0.4 against 1.0, recall 1 for both
    assert gold_recall("Anjali lives in Bristol.", "Bristol", 4) == gold_recall("Bristol", "Bristol", 4) == 1.0
    assert locomo_f1("Anjali lives in Bristol.", "Bristol", 4) == pytest.approx(0.4)
    assert gold_recall("She moved on 7 May 2023.", "7 May 2023", 2) == 1.0
    assert gold_recall("In May 2023.", "7 May 2023", 2) == pytest.approx(2 / 3)  # the day is missing
    assert gold_recall("Running marathons", "ran the marathon", 2) == pytest.approx(0.5)  # stems: marathon, not ran
    assert gold_recall("I don't know.", "Bristol", 4) == 0.0 and gold_recall("", "Bristol", 1) == 0.0
    assert gold_recall("anything", "the", 4) == 1.0  # no gold tokens left
    assert gold_recall("Paris", "Paris; France", 3) == 1.0 and gold_recall("France", "Paris; France", 3) == 0.0
    assert gold_recall("Not mentioned in the conversation.", "x", 5) == 1.0  # adversarial: as LoCoMo scores it
    with pytest.raises(ValueError, match="category"):
        gold_recall("a", "a", 6)
