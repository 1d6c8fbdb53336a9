"""`--order` means one thing in every benchmark (`bench_args.ORDERS`): relevance is retrieval's order,
most relevant first (the server's); relevance_last puts the most relevant next to the question."""

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_args import ORDERS, arrange  # noqa: E402


@given(st.lists(st.integers(0, 1000), unique=True, max_size=20))
def test_each_order_arranges_retrieval_s_best_first_list(best_first):
    assert arrange(best_first, "relevance") == best_first
    assert arrange(best_first, "relevance_last") == best_first[::-1]
    assert arrange(best_first, "conversation") == sorted(best_first)
    with pytest.raises(ValueError, match="order"):
        arrange(best_first, "least_relevant")


def test_every_benchmark_takes_the_same_orders():
    import fidelity
    import locomo

    assert fidelity.parse_args(["--order", "relevance_last"]).order == "relevance_last"
    assert locomo.parse_args(["--order", "relevance_last"]).order == "relevance_last"
    assert fidelity.parse_args(["--order", "relevance"]).order == locomo.parse_args([]).order == "relevance"
    for script in (Path(fidelity.__file__), Path(locomo.__file__)):
        assert "ORDERS" in script.read_text()  # the choices come from one place
    assert set(ORDERS) == {"conversation", "relevance", "relevance_last"}
