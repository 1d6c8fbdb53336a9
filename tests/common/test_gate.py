"""The quality gate: choosing the cheapest passing policy per k, deciding for any k, the file."""

import json

import pytest

from inferscale.common.gate import FILE, Calibration, Measured, decide, encoding_key, worst_cases


def measured():
    return [Measured(10, "none", 0.170, 0.190, 0.0, 40), Measured(10, "last:2", 0.187, 0.190, 0.2, 40),
            Measured(10, "last:5", 0.192, 0.190, 0.5, 40),
            Measured(50, "none", 0.110, 0.220, 0.0, 40), Measured(50, "last:5", 0.200, 0.220, 0.1, 40)]


def test_the_cheapest_passing_policy_per_k():
    cal = Calibration.from_measurements("fp", measured(), tolerance=0.005)
    assert cal.choices == {10: "last:2", 50: None}  # last:2 is 0.3 points below text; nothing passes at 50
    assert Calibration.from_measurements("fp", measured(), tolerance=0.03).choices == {10: "none", 50: "last:5"}


def test_over_several_conversations_a_policy_must_pass_on_each():
    on = lambda conv, policy, f1, share: Measured(10, policy, f1, 0.190, share, 40, 0.01, conv)  # noqa: E731
    runs = [on("conv-26", "last:2", 0.189, 0.2), on("conv-30", "last:2", 0.150, 0.2),  # passes on one only
            on("conv-26", "last:5", 0.191, 0.5), on("conv-30", "last:5", 0.187, 0.5)]  # on both
    cal = Calibration.from_measurements("fp", runs, tolerance=0.005)
    assert cal.choices == {10: "last:5"}  # last:2's mean gap (2.05 points) or best case does not decide
    worst = {m.policy: m for m in worst_cases(runs)}
    assert worst["last:2"].data == "conv-30" and round(100 * worst["last:2"].gap, 1) == 4.0


@pytest.mark.parametrize("k,mode,policy,why", [
    (1, "inject", "last:2", "calibrated at k=10"), (10, "inject", "last:2", "k=10"),
    (11, "text", None, "within 0.005 F1 of text at k=50"), (50, "text", None, "k=50"),
    (51, "text", None, "beyond the calibrated k"),
])
def test_decide_for_any_k(k, mode, policy, why):
    d = decide(Calibration.from_measurements("fp", measured(), 0.005), k)
    assert (d.mode, d.policy) == (mode, policy) and why in d.reason


def test_uncalibrated_serves_text():
    d = decide(None, 10)
    assert (d.mode, d.policy) == ("text", None) and "not calibrated" in d.reason


def test_a_calibration_applies_only_to_memory_encoded_the_same_way(tmp_path):
    Calibration.from_measurements("fp-a", measured(), 0.005, encoding=encoding_key("turns", 5)).save(tmp_path)
    assert Calibration.load(tmp_path, "fp-a", encoding_key("turns", 5)).encoding == "turns:5"
    assert Calibration.load(tmp_path, "fp-a", encoding_key("facts", 5)) is None
    assert Calibration.load(tmp_path, "fp-a", encoding_key("turns", 0)) is None
    assert Calibration.load(tmp_path, "fp-a", encoding_key("turns", 5, boundary=True)) is None  # laid out otherwise


def test_saved_and_loaded_per_model(tmp_path):
    cal = Calibration.from_measurements("fp-a", measured(), 0.005, data="locomo:conv-26:40 questions")
    cal.save(tmp_path)
    got = Calibration.load(tmp_path, "fp-a")
    assert got.choices == cal.choices and got.measured == cal.measured and got.tolerance == 0.005
    assert Calibration.load(tmp_path, "fp-b") is None  # another model's calibration does not apply
    assert Calibration.load(tmp_path / "nowhere", "fp-a") is None
    (tmp_path / FILE).write_text(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="unreadable"):
        Calibration.load(tmp_path, "fp-a")


@pytest.mark.parametrize("kw,msg", [(dict(tolerance=-0.1), "tolerance"), (dict(choices={0: None}), "positive"),
                                    (dict(choices={10: "blend:20"}), "cannot be served")])
def test_bad_calibrations_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Calibration(**{"model_fingerprint": "fp", "tolerance": 0.005, "choices": {}, **kw})


def test_the_memory_root_s_calibration_first_then_the_shipped_one_then_text(tmp_path, monkeypatch):
    from inferscale.common import gate

    monkeypatch.setattr(gate, "SHIPPED", tmp_path / "shipped")
    enc = encoding_key("turns", 5)
    assert Calibration.find(tmp_path / "root", "fp-a", enc) is None  # nothing anywhere: text
    shipped = Calibration.from_measurements("fp-a", measured(), 0.03, encoding=enc)
    shipped.save("", gate.shipped_file("fp-a", enc))
    got = Calibration.find(tmp_path / "root", "fp-a", enc)
    assert got.source == "shipped" and got.choices == {10: "none", 50: "last:5"}
    assert "shipped calibration" in decide(got, 10).reason
    assert Calibration.find(tmp_path / "root", "fp-a", encoding_key("facts", 5)) is None  # another encoding
    assert Calibration.find(tmp_path / "root", "fp-b", enc) is None  # another model
    Calibration.from_measurements("fp-a", measured(), 0.005, encoding=enc).save(tmp_path / "root")
    own = Calibration.find(tmp_path / "root", "fp-a", enc)
    assert own.source == "memory root" and own.choices == {10: "last:2", 50: None}
    assert "memory root calibration" in decide(own, 10).reason


def test_every_shipped_calibration_is_readable_and_servable():
    from inferscale.common import gate

    files = sorted(gate.SHIPPED.glob("*.json"))
    for f in files:
        raw = json.loads(f.read_text())
        cal = Calibration.load("", raw["model_fingerprint"], raw["encoding"], path=f, source="shipped")
        assert f == gate.shipped_file(cal.model_fingerprint, cal.encoding)
        assert cal.measured and all(m.n >= 1 for m in cal.measured) and cal.data
        # its choices are the worst case of what it records, on every conversation it names
        assert Calibration.from_measurements(cal.model_fingerprint, cal.measured, cal.tolerance).choices == cal.choices
        named = {part.split(":")[1] for part in cal.data.split(", ")}
        assert {m.data for m in cal.measured} == named == set(cal.settings)  # a later run can extend it
