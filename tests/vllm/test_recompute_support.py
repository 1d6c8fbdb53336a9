"""What the connector's recompute path refuses (then plans are injected plainly), checked on
stand-in modules without an engine."""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from inferscale.common.model.spec import ModelSpec  # noqa: E402
from inferscale.vllm.recompute import Unsupported, attend, check_model  # noqa: E402


def _spec(**kw):
    return ModelSpec.from_hf_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "vocab_size": 100, "max_position_embeddings": 256, **kw})


class _Attn(torch.nn.Module):
    def __init__(self, heads=4):
        super().__init__()
        self.qkv_proj, self.o_proj, self.num_heads, self.num_kv_heads = torch.nn.Identity(), torch.nn.Identity(), heads, 2


class _Layer(torch.nn.Module):
    def __init__(self, heads=4):
        super().__init__()
        self.self_attn, self.mlp = _Attn(heads), torch.nn.Identity()
        self.input_layernorm, self.post_attention_layernorm = torch.nn.Identity(), torch.nn.Identity()


class _Decoder(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def embed_input_ids(self, ids):
        return ids


def _model(layers):
    m = torch.nn.Module()
    m.model = _Decoder(layers)
    return m


def test_a_model_the_path_does_not_cover_is_named():
    spec = _spec()
    assert check_model(_model([_Layer(), _Layer()]), spec) is not None
    with pytest.raises(Unsupported, match="no decoder"):
        check_model(torch.nn.Linear(2, 2), spec)
    with pytest.raises(Unsupported, match="pipeline"):
        check_model(_model([_Layer()]), spec)
    with pytest.raises(Unsupported, match="tensor parallelism"):
        check_model(_model([_Layer(), _Layer(heads=2)]), spec)
    with pytest.raises(Unsupported, match="q_norm"):
        check_model(_model([_Layer(), _Layer()]), _spec(model_type="qwen3", head_dim=16))


def test_attend_is_causal_by_serving_position_and_windowed():
    """Queries at positions 2 and 5 over 8 keys: each sees only keys at or before it (and within a
    window of 2, the last two), as a dense softmax per query computes."""
    torch.manual_seed(0)
    q, K, V = torch.randn(2, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    pos = torch.tensor([2, 5])
    for window in (None, 2):
        got = attend(q, K, V, pos, 0.5, window).reshape(2, 4, 8)
        for i, p in enumerate(pos.tolist()):
            lo = 0 if window is None else p - window + 1
            for h in range(4):
                w = torch.softmax(K[lo: p + 1, h // 2] @ q[i, h] * 0.5, 0)
                torch.testing.assert_close(got[i, h], w @ V[lo: p + 1, h // 2], rtol=1e-5, atol=1e-5)
