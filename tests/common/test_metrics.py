"""Hand-computed cases for inferscale.common.metrics (SQuAD F1, BLEU-1)."""

import math

import pytest

from inferscale.common.metrics import aggregate, bleu1, normalize_answer, token_f1, tokens


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
