"""Answer-quality metrics for QA benchmarks (LoCoMo): token F1, LoCoMo's F1 and BLEU-1.

Standard library only, except `locomo_f1`, which uses nltk's Porter stemmer (the `eval` extra).

Conventions:

* `normalize_answer` is the SQuAD v1.1 normalisation (Rajpurkar et al., 2016, the official
  `evaluate-v1.1.py`): lowercase, drop punctuation, drop the articles a/an/the, collapse
  whitespace. LoCoMo's evaluation (Maharana et al., ACL 2024, `task_eval/evaluation.py`) uses the
  same normalisation (it also removes commas first, which punctuation removal already covers).
* `token_f1` is SQuAD's token-level F1 on normalised tokens (bag-of-tokens overlap, counts
  clipped).
* `locomo_f1` is the F1 of LoCoMo's own evaluation, per question category: "and" is dropped
  with the articles, every token is Porter-stemmed (nltk), multi-hop answers (category 1) are
  split at commas and each gold part is matched by its best predicted part (mean over gold
  parts), open-domain gold answers (category 3) keep their first ';'-separated alternative, and
  adversarial questions (category 5) score 1 when the prediction says "no information available"
  or "not mentioned".
* `gold_recall` is gold-token recall: the share of the gold answer's tokens (LoCoMo's: stemmed,
  without a/an/the/and; category 3 keeps the first ';'-separated alternative) that the
  prediction contains. It measures whether the answer says what the gold answer says, not how
  much else it says: "Anjali lives in Bristol." and "Bristol" both score 1 against "Bristol",
  where LoCoMo's F1 gives them 0.4 and 1.0. The quality gate decides on it (`gate.calibration`).
* `bleu1` is BLEU (Papineni et al., ACL 2002) restricted to unigrams: clipped unigram precision
  times the brevity penalty, one reference, no smoothing (as in the BLEU-1 numbers reported by
  LoCoMo and Mem0, which use NLTK's `sentence_bleu` with weights (1, 0, 0, 0)).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from typing import Any, Callable, Iterable, Mapping

__all__ = ["normalize_answer", "tokens", "token_f1", "locomo_f1", "gold_recall", "bleu1", "aggregate"]

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_LOCOMO_STOP_RE = re.compile(r"\b(a|an|the|and)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: Any) -> str:
    """SQuAD v1.1 normalisation: lowercase, remove punctuation, remove articles, collapse whitespace.

    Non-strings (LoCoMo has integer answers such as 2022) are converted with `str` first."""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES_RE.sub(" ", s)
    return " ".join(s.split())


def tokens(s: Any) -> list[str]:
    """The normalised tokens of `s` (whitespace split of `normalize_answer(s)`)."""
    return normalize_answer(s).split()


def token_f1(prediction: Any, gold: Any) -> float:
    """SQuAD-style token F1 between a prediction and a gold answer, on normalised tokens.

    Both empty (after normalisation): 1.0; exactly one empty: 0.0; otherwise
    2PR / (P + R) with P = overlap / |prediction|, R = overlap / |gold|, overlap counted as a
    multiset intersection."""
    return _f1(tokens(prediction), tokens(gold))


def _f1(p: list[str], g: list[str]) -> float:
    if not p or not g:
        return float(p == g)
    overlap = sum((Counter(p) & Counter(g)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(p), overlap / len(g)
    return 2 * precision * recall / (precision + recall)


def _stemmed(s: Any) -> list[str]:
    """LoCoMo's tokens: lowercase, no punctuation (commas included), no a/an/the/and, Porter stems."""
    try:
        from nltk.stem import PorterStemmer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("locomo_f1 needs nltk (pip install 'inferscale[eval]')") from e
    s = "".join(ch for ch in str(s).lower() if ch not in _PUNCT)
    stem = PorterStemmer().stem
    return [stem(t) for t in _LOCOMO_STOP_RE.sub(" ", s).split()]


def locomo_f1(prediction: Any, gold: Any, category: int) -> float:
    """LoCoMo's per-category F1 (Maharana et al., 2024, `task_eval/evaluation.py`); see the module
    docstring. Categories: 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial."""
    if category not in (1, 2, 3, 4, 5):
        raise ValueError(f"LoCoMo category must be 1-5, got {category!r}")
    prediction, gold = str(prediction), str(gold)
    if category == 5:
        low = prediction.lower()
        return float("no information available" in low or "not mentioned" in low)
    if category == 1:
        preds = [_stemmed(p) for p in prediction.split(",")]
        golds = [_stemmed(g) for g in gold.split(",")]
        return sum(max(_f1(p, g) for p in preds) for g in golds) / len(golds)
    if category == 3:
        gold = gold.split(";")[0].strip()
    return _f1(_stemmed(prediction), _stemmed(gold))


def gold_recall(prediction: Any, gold: Any, category: int) -> float:
    """Gold-token recall (see the module docstring): the share of the gold answer's distinct
    LoCoMo tokens found among the prediction's; 1.0 for a gold answer without tokens. Category 5
    (adversarial) scores as `locomo_f1` does."""
    if category not in (1, 2, 3, 4, 5):
        raise ValueError(f"LoCoMo category must be 1-5, got {category!r}")
    if category == 5:
        return locomo_f1(prediction, gold, 5)
    gold = str(gold)
    if category == 3:
        gold = gold.split(";")[0].strip()
    want = set(_stemmed(gold))
    return len(want & set(_stemmed(prediction))) / len(want) if want else 1.0


def bleu1(prediction: Any, gold: Any) -> float:
    """BLEU-1 of a prediction against one gold answer, on normalised tokens, without smoothing.

    Clipped unigram precision (each prediction token counts at most as often as it appears in
    the gold answer) times the brevity penalty BP = 1 if c > r else exp(1 - r / c), with c the
    prediction length and r the gold length (Papineni et al., 2002). An empty prediction scores 0."""
    p, g = tokens(prediction), tokens(gold)
    if not p:
        return 0.0
    clipped = sum((Counter(p) & Counter(g)).values())
    precision = clipped / len(p)
    c, r = len(p), len(g)
    bp = 1.0 if c > r else math.exp(1 - r / c)
    return precision * bp


def aggregate(rows: Iterable[Mapping[str, Any]], key: str | Callable[[Mapping[str, Any]], Any],
              metrics: Iterable[str] = ("f1", "bleu1")) -> dict[Any, dict[str, float]]:
    """Means of `metrics` over `rows` grouped by `key` (a field name, or a function of the row).

    Returns {group: {"n": count, metric: mean, ...}}, groups in first-seen order. Rows lacking a
    metric (or with None) are left out of that metric's mean."""
    metrics = tuple(metrics)
    get = key if callable(key) else (lambda r: r.get(key))
    sums: dict[Any, dict[str, list[float]]] = {}
    counts: dict[Any, int] = {}
    for row in rows:
        gk = get(row)
        counts[gk] = counts.get(gk, 0) + 1
        acc = sums.setdefault(gk, {m: [0.0, 0] for m in metrics})
        for m in metrics:
            v = row.get(m)
            if v is not None:
                acc[m][0] += float(v)
                acc[m][1] += 1
    out: dict[Any, dict[str, float]] = {}
    for gk, acc in sums.items():
        out[gk] = {"n": counts[gk], **{m: (s / n if n else float("nan")) for m, (s, n) in acc.items()}}
    return out
