"""MemoryLLMConfig and MemoryRequest refuse bad values with a message naming the field."""

import pytest

pytest.importorskip("torch")

from inferscale.serving.memory_llm import MemoryLLMConfig, MemoryRequest  # noqa: E402


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize("field,value", [("w", -1), ("block_size", 0), ("dtype", "int8"), ("max_model_len", 8),
                                         ("encoder_device", "gpu"), ("encoder_device", "cuda:x"),
                                         ("encode_mode", "batched"), ("query_weights", "int4"),
                                         ("tolerance", 5), ("tolerance", -0.1), ("tolerance", True),
                                         ("chain_repeat", -1)])
def test_config_rejects(model, field, value):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        MemoryLLMConfig(model=model, memory_root="mem", **{field: value})


def test_config_accepts_devices(model):
    for dev in ("auto", "cpu", "cuda", "cuda:1"):
        assert MemoryLLMConfig(model=model, memory_root="mem", encoder_device=dev).encoder_device == dev
    with pytest.raises(ValueError, match="model"):
        MemoryLLMConfig(model=model + "/nope", memory_root="mem")


def test_request_is_validated():
    assert MemoryRequest("u", "q", fact_ids=["a", "b"]).fact_ids == ("a", "b")
    with pytest.raises(ValueError, match="mode"):
        MemoryRequest("u", "q", mode="prompt")
    with pytest.raises(ValueError, match="max_tokens"):
        MemoryRequest("u", "q", max_tokens=0)
    assert MemoryRequest("u", "q", k="all", repeat=3).repeat == 3 and MemoryRequest("u", "q", mode="chain", repeat=2)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="repeat"):
            MemoryRequest("u", "q", k="all", repeat=bad)
    with pytest.raises(ValueError, match="repeat applies to the whole memory"):
        MemoryRequest("u", "q", k=5, repeat=2)


def test_max_model_len_beyond_what_the_model_serves_exactly_is_refused(tmp_path):
    """A LongRoPE model (the tiny Phi-4-mini-like one: original context 256) is served within its
    original context; vLLM would switch every position to the long factors past it."""
    from tiny_models import make_tiny_model

    from inferscale.serving.composer import MemoryComposer

    make_tiny_model(tmp_path / "phi", "phi3", num_layers=1, max_position_embeddings=256)
    with pytest.raises(ValueError, match="max_model_len 512 is beyond what this model serves exactly \\(256"):
        MemoryComposer(MemoryLLMConfig(model=str(tmp_path / "phi"), memory_root=str(tmp_path / "m"), max_model_len=512))
