"""benchmarks/store_error.py on two users holding the same encodings in float32 and int8."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import locomo  # noqa: E402
import store_error  # noqa: E402


def test_store_error_reports_each_dtype_against_float32(tmp_path, capsys):
    from doubles import HashEmbedder, WindowEncoder

    from inferscale.common.facts import Fact, Turn
    from inferscale.memory.service import MemoryService
    from inferscale.memory.service_types import MemoryConfig

    enc = locomo.ReusedEncodings(WindowEncoder())
    root = str(tmp_path / "m")
    services = {(2, d): MemoryService(MemoryConfig(root=root, w=2, kv_dtype=d), enc, HashEmbedder())
                for d in ("float32", "int8", "bfloat16")}
    users = {key: locomo.user_of("c", 2, "turns", key[1]) for key in services}
    turns = [Turn(f"D1:{i}", "Ann", f"turn {i}") for i in range(4)]
    locomo.ingest(services, users, "c", turns, [Fact("a", "Ann likes tea.", "D1:1"), Fact("b", "Ann rows.", "D1:3")])
    for svc in services.values():
        svc.close()
    store_error.main([root, "--user", "c-w2"])
    out = capsys.readouterr().out
    assert "c-w2: 2 facts; largest |K|" in out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ") and "dtype" not in line}
    assert set(rows) == {"int8", "bfloat16"}
    rel_k = {d: float(r.split(" | ")[3]) for d, r in rows.items()}
    assert 0 < rel_k["bfloat16"] < rel_k["int8"] < 0.05  # bf16: 8 mantissa bits; int8: 1/254 of a channel's max
    with pytest.raises(SystemExit, match="not float32"):
        store_error.main([root, "--user", "c-w2-int8"])
    alone = MemoryService(MemoryConfig(root=str(tmp_path / "m2"), w=2, kv_dtype="float32"), WindowEncoder(),
                          HashEmbedder())
    alone.add("c-w2", turns=turns, facts=[Fact("a", "Ann likes tea.", "D1:1")])
    alone.close()
    with pytest.raises(SystemExit, match="no users"):
        store_error.main([str(tmp_path / "m2"), "--user", "c-w2"])
