"""The LoCoMo benchmark's plain-Python parts: argument checks, selection, scoring and summaries
(hand-computed), the KV footprint arithmetic and resumable rows (a later line wins)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import locomo  # noqa: E402
import locomo_report as report  # noqa: E402



def _row(method, w, k, qi, pred, gold, cat, **kw):
    return dict(conversation="c", method=method, w=w, k=k, question_idx=qi, category=cat, prediction=pred,
                gold=gold, **kw)


def test_arguments_are_checked():
    a = locomo.parse_args(["--quick"])
    assert a.k == (10,) and a.w == (0, 5) and a.limit == 8 and a.max_facts == 60 and a.judge is None
    a = locomo.parse_args(["--k", "10,50", "--w", "0,50", "--judge-url", "http://j.test/v1", "--judge-model", "m"])
    assert a.k == (10, 50) and a.judge.model == "m" and a.max_facts is None
    a = locomo.parse_args(["--w", "0,5", "--policies", "none,last:2", "--order", "relevance_last"])
    assert a.policies == ("none", "last:2") and a.order == "relevance_last"
    assert [m for m, *_ in locomo.grid_methods(a)] == ["text", "inject", "inject+last:2", "inject", "inject+last:2"]
    a = locomo.parse_args(["--w", "5", "--policies", "none,last:2", "--context", "facts"])
    assert [m for m, *_ in locomo.grid_methods(a)] == ["text", "inject[facts]", "inject[facts]+last:2"]
    assert locomo.user_of("conv-26", 5, "facts") == "conv-26-w5-facts" and locomo.user_of("c", 0, "turns") == "c-w0"
    a = locomo.parse_args(["--w", "5", "--policies", "none,last:2", "--kv-dtype", "float32,int8", "--skip", "text"])
    assert a.kv_dtype == ("float32", "int8")
    assert locomo.grid_methods(a) == [("inject", 5, "none", "float32"), ("inject+last:2", 5, "last:2", "float32"),
                                      ("inject{int8}", 5, "none", "int8"), ("inject{int8}+last:2", 5, "last:2", "int8")]
    assert locomo.user_of("c", 5, "turns", "int8") == "c-w5-int8"
    assert locomo.user_of("c", 5, "conversation", "bfloat16") == "c-w5-conversation-bfloat16"
    assert locomo.parse_args([]).kv_dtype == ("float32",)
    a = locomo.parse_args(["--w", "5", "--policies", "none,last:5", "--boundary", "both"])
    assert [m for m, *_ in locomo.grid_methods(a)] == ["text", "inject", "inject+last:5", "text+end", "inject+end",
                                                       "inject+last:5+end"]
    assert [locomo.with_boundary(m) for m, *_ in locomo.grid_methods(a)] == [False] * 3 + [True] * 3
    assert locomo.ttft_methods(a) == ("joint", "inject", "inject+last:5", "joint+end", "inject+end",
                                      "inject+last:5+end", "none")  # TTFT times the grid's methods
    a = locomo.parse_args(["--policies", "none", "--boundary", "yes", "--skip", "answers"])  # TTFT alone
    assert locomo.ttft_methods(a) == ("joint+end", "inject+end", "none") and "answers" in a.skip
    a = locomo.parse_args(["--judge-url", "local"])  # the benchmark's model, served after the answers
    assert a.judge_local and a.judge is None
    for bad in (["--judge-url", "http://j.test/v1"], ["--judge-url", "local", "--judge-model", "m"], ["--skip", "ttft,nope"], ["--k", "0"], ["--kv-dtype", "int4"],
                ["--kv-dtype", ","],
                ["--judge-url", "j.test", "--judge-model", "m"], ["--policies", "blend:20"], ["--policies", "x"]):
        with pytest.raises(SystemExit):
            locomo.parse_args(bad)


def test_the_local_judge_is_the_model_served_without_memory(tmp_path):
    import local_judge

    cmd = local_judge.judge_command("/models/qwen", str(tmp_path), 8123, 4)
    assert cmd[1:4] == ["-m", "inferscale.cli", "serve"] and cmd[-2:] == ["--model", "/models/qwen"]
    assert "--port" in cmd and "8123" in cmd and "127.0.0.1" in cmd


def test_select_samples_by_count_or_name():
    class S:
        def __init__(self, i):
            self.conversation = type("C", (), {"id": i})

    ss = [S("a"), S("b"), S("c")]
    assert [s.conversation.id for s in locomo.select_samples(ss, "2")] == ["a", "b"]
    assert [s.conversation.id for s in locomo.select_samples(ss, "c,a")] == ["c", "a"]
    assert locomo.select_samples(ss, None) == ss
    with pytest.raises(SystemExit, match="zz"):
        locomo.select_samples(ss, "a,zz")


def test_summary_means_per_method_w_k_and_category():
    pytest.importorskip("nltk")
    rows = [_row("text", None, 10, 0, "Paris", "Paris", 4, gold_ll=-1.0),
            _row("text", None, 10, 1, "dog", "cat", 2, gold_ll=-3.0),
            _row("inject", 5, 10, 0, "the cat sat on the mat", "a cat on a mat", 4, gold_ll=-2.0, judge=1),
            _row("inject", 5, 10, 1, "dog", "cat", 2, gold_ll=None, judge=0)]
    (text, inject) = report.summarise(rows)
    assert (text["method"], inject["method"], inject["w"]) == ("text", "inject", 5)
    assert text["n"] == 2 and text["f1"] == pytest.approx(0.5) and text["gold_ll"] == pytest.approx(-2.0)
    assert text["judge"] is None and text["judged"] == 0
    # F1 6/7 (see test_metrics) and 0; gold_ll: only the row that has one
    assert inject["f1"] == pytest.approx(3 / 7) and inject["gold_ll"] == pytest.approx(-2.0)
    assert inject["judge"] == pytest.approx(0.5) and inject["judged"] == 2
    assert inject["by_category"]["4"]["n"] == 1 and inject["by_category"]["2"]["f1"] == 0.0
    md = report.markdown([text, inject], (2, 4))
    assert "| inject | 5 | 10 | 2 |" in md and "judge" in md
    assert text["evidence_recall"] is None  # no row carries one


def test_dtype_methods_are_compared_with_their_float32_method():
    pytest.importorskip("nltk")
    rows = [_row("inject", 5, 10, 0, "Paris", "Paris", 4), _row("inject", 5, 10, 1, "a dog", "cat", 2),
            _row("inject{int8}", 5, 10, 0, "Paris", "Paris", 4), _row("inject{int8}", 5, 10, 1, "a  cat", "cat", 2),
            _row("inject{int8}+last:2", 5, 10, 0, "Paris", "Paris", 4), _row("inject+last:2", 5, 10, 0, "Rome", "Paris", 4)]
    by = {s["method"]: s for s in report.summarise(rows)}
    assert by["inject"]["same_as_float32"] is None and by["inject{int8}"]["same_as_float32"] == pytest.approx(0.5)
    assert by["inject{int8}+last:2"]["same_as_float32"] == 0.0  # its reference is inject+last:2
    md = report.markdown(list(by.values()), (2, 4))
    assert "= float32" in md and "| inject{int8} | 5 | 10 | 2 |" in md
    assert "= float32" not in report.markdown([by["inject"]], (2, 4))


def test_reused_encodings_store_one_encoding_in_every_dtype(tmp_path):
    from dataclasses import replace

    from doubles import HashEmbedder, WindowEncoder

    from inferscale.common.facts import Fact, Turn
    from inferscale.common.storage.local_store import Store
    from inferscale.memory.service import MemoryService
    from inferscale.memory.service_types import MemoryConfig

    enc = locomo.ReusedEncodings(WindowEncoder())
    root = str(tmp_path / "m")
    services = {(2, d): MemoryService(MemoryConfig(root=root, w=2, kv_dtype=d), enc, HashEmbedder())
                for d in ("float32", "int8")}
    users = {key: locomo.user_of("c", 2, "turns", key[1]) for key in services}
    turns = [Turn(f"D1:{i}", "Ann", f"turn {i}") for i in range(5)]
    facts = [Fact("a", "Ann likes tea.", "D1:2"), Fact("b", "Ann has a cat.", "D1:4")]
    locomo.ingest(services, users, "c", turns, facts)
    assert (enc.encoded, enc.reused, len(enc.inner.calls)) == (2, 2, 1)  # encoded once, stored twice
    f32, i8 = (services[key].load_kv(users[key], ["a", "b"]) for key in services)
    meta = services[(2, "int8")].store(users[(2, "int8")]).meta
    assert meta.dtype == "int8"
    ref = Store.create(tmp_path / "ref", meta)  # what an int8 store makes of the float32 encodings
    ref.put([replace(kv) for kv in f32])
    for got, want, orig in zip(i8, ref.get([kv.fact_id for kv in f32]), f32):
        np.testing.assert_array_equal(got.k, want.k)
        np.testing.assert_array_equal(got.v, want.v)
        assert 0 < np.abs(got.k - orig.k).max() <= np.abs(orig.k).max() / 127 + 1e-6
    for svc in services.values():
        svc.close()


def test_fact_set_mismatches():
    a = _row("text", None, 10, 0, "x", "y", 1, facts=["f1", "f2"])
    b = _row("inject", 5, 10, 0, "x", "y", 1, facts=["f1", "f2"])
    assert report.fact_set_mismatches([a, b]) == 0
    assert report.fact_set_mismatches([a, dict(b, facts=["f2", "f1"])]) == 1


def test_kv_footprint_arithmetic():
    spec = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's KV shape
    fp = report.kv_footprint(spec, tokens=1000, facts=10, text_bytes=5000, stored_bytes=123, stored_dtype="float32")
    per_token = 30 * 2 * 3 * 64  # layers x (K, V) x KV heads x head dim
    assert fp["kv_bytes"] == {"float32": 4 * per_token * 1000, "bfloat16": 2 * per_token * 1000,
                              "float16": 2 * per_token * 1000, "fp8": per_token * 1000}
    md = report.footprint_markdown({"c": fp, "c (int8)": dict(fp, stored_bytes_on_disk=15_000_000, stored_dtype="int8")})
    assert "10 | 1,000 |" in md and "| 14.3 (int8) | 15,000 |" in md


def test_rows_resume_and_a_later_line_wins(tmp_path):
    path = tmp_path / "results.jsonl"
    a = _row("inject", 0, 10, 3, "x", "y", 1)
    lines = [json.dumps(a), json.dumps(dict(a, judge=1)), '{"conversation": "c", "meth']  # the last cut short
    path.write_text("\n".join(lines))
    done = report.load_rows(path)
    assert list(done) == [("c", "inject", 0, 10, 3)] and done[("c", "inject", 0, 10, 3)]["judge"] == 1


def test_what_the_service_refuses_is_skipped_and_reported(tmp_path, capsys):
    from doubles import HashEmbedder, WindowEncoder

    from inferscale.common.facts import Fact, Turn
    from inferscale.memory.service import MemoryService
    from inferscale.memory.service_types import MemoryConfig

    svc = MemoryService(MemoryConfig(root=str(tmp_path / "m"), w=2, max_text_chars=1200), WindowEncoder(),
                        HashEmbedder())
    turns = [Turn("D1:1", "Ann", "short"), Turn("D7:53", "Ann", "x" * 1202), Turn("D7:54", "Bo", "ok")]
    facts = [Fact("a", "Ann is short.", "D1:1"), Fact("b", "Ann talked.", "D7:53"), Fact("c", "y" * 1300, "D7:54")]
    keep_turns, keep_facts = locomo.ingestible(svc, "conv-x", turns, facts)
    assert [t.id for t in keep_turns] == ["D1:1", "D7:54"] and [f.id for f in keep_facts] == ["a"]
    out = capsys.readouterr().out
    assert "skipping turn D7:53: turn 'D7:53' has 1202 characters; the limit is 1200" in out
    assert "skipping fact b: its source turn 'D7:53' was skipped" in out
    assert "skipped 3 of 6 turns and facts" in out
    locomo.ingest({2: svc}, {2: "conv-x"}, "conv-x", turns, facts)  # ingests the rest instead of stopping
    assert [f.fact_id for f in svc.list("conv-x")] == ["a"]


def test_the_judge_reuses_the_verdict_of_an_identical_answer():
    """The judge is greedy: a row answering as an already-judged row takes its verdict, unasked."""
    import io

    judged = dict(_row("text", None, 10, 0, "In May", "May 2023", 2), question="When?", judge=1, judge_reply="ok")
    same = dict(_row("inject", 5, 10, 0, "In May", "May 2023", 2), question="When?")
    done = {report.row_key(r): r for r in (judged, same)}
    fh = io.StringIO()
    args = SimpleNamespace(judge=None)  # no endpoint: nothing may be asked
    assert locomo.run_judge(args, done, lambda r: True, fh) == 1
    assert done[report.row_key(same)]["judge"] == 1 and done[report.row_key(same)]["judge_reply"] == "ok"
    assert json.loads(fh.getvalue())["method"] == "inject"


def test_the_judge_asks_each_distinct_answer_once(monkeypatch):
    """Methods that give the same answer to a question share one verdict, across the whole run; a
    reply without a label is kept and not asked again."""
    import io

    from inferscale.evaluation import judge as judge_mod

    asked = []

    class Judge:
        def __init__(self, config):
            pass

        def judge_many(self, items):
            asked.extend(items)
            return [judge_mod.Verdict(None if p == "Maybe" else p == "In May", "r") for _, _, p in items]

    monkeypatch.setattr(judge_mod, "Judge", Judge)
    methods = (("text", "In May"), ("inject", "In May"), ("inject+last:2", "June"), ("inject+last:5", "Maybe"))
    rows = [dict(_row(m, 5, 10, qi, pred, "May 2023", 2), question=f"When {qi}?") for qi in range(40) for m, pred in methods]
    done = {report.row_key(r): r for r in rows}
    assert locomo.run_judge(SimpleNamespace(judge=None), done, lambda r: True, io.StringIO()) == 120
    assert len(asked) == 120  # three distinct answers per question
    for r in done.values():
        if r["prediction"] == "Maybe":  # no label: the reply is kept, the verdict stays open
            assert r.get("judge") is None and r["judge_reply"] == "r"
        else:
            assert r["judge"] == (r["prediction"] == "In May")
    asked.clear()  # a resumed run asks nothing again: the judge is greedy
    assert locomo.run_judge(SimpleNamespace(judge=None), done, lambda r: True, io.StringIO()) == 0 and not asked


def test_a_ttft_method_ending_in_end_is_served_with_the_memorys_boundary():
    import ttft

    calls = []

    def generate(user, question, **kw):
        calls.append(kw)
        return SimpleNamespace(timings={"engine": 0.1, "compose": 0.01}, ttft_s=0.2, num_prompt=9, num_injected=5,
                               token_ids=[1])

    llm = SimpleNamespace(generate=generate)
    cached = SimpleNamespace(last=0)
    for method in ("joint", "joint+end", "inject", "inject+end", "inject+heads:4", "inject+heads:4+last:2+end"):
        row = ttft.run_one(llm, cached, method, "q?", 10, ["a", "b"], 0.05, "salt")
        assert row["method"] == method and row["e2e_s"] == pytest.approx(0.25)
    assert [(c["mode"], c.get("policy"), c["boundary"]) for c in calls] == [
        ("text", None, False), ("text", None, True), ("inject", None, False), ("inject", None, True),
        ("inject", "heads:4", False), ("inject", "heads:4+last:2", True)]
    # a policy's +end twin shares no prefix-cache blocks with the same request without the boundary
    assert calls[4].get("cache_salt") is None and len(calls[5]["cache_salt"]) == 32
