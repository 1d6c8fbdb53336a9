"""`TorchFactEncoder.encode_after` (how the memory chain extends itself: only the new facts run,
after the stored links' KV) against one pass over everything, on every family's tiny model."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from tiny_models import make_tiny_model  # noqa: E402

from inferscale.encoders.torch_encoder import TorchFactEncoder  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3"]


@pytest.fixture(scope="module", params=FAMILIES + ["gemma3_text"])
def encoder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(path, request.param)
    return TorchFactEncoder(path, max_context=512)


@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_extending_stored_kv_is_one_pass_over_everything(encoder, data):
    ids = data.draw(st.lists(st.integers(5, 200), min_size=2, max_size=80))
    cut = data.draw(st.integers(1, len(ids) - 1))
    ((k, v),) = encoder.encode_ids([((), ids)])
    if not encoder.extends_kv:  # Gemma 3: sliding layers rotate with their own embedding
        assert encoder.spec.family == "gemma3_text"
        with pytest.raises(NotImplementedError, match="rotary"):
            encoder.encode_after(k[:, :cut], v[:, :cut], ids[cut:])
        return
    k_ext, v_ext = encoder.encode_after(k[:, :cut], v[:, :cut], ids[cut:])
    scale = max(np.abs(k).max(), np.abs(v).max())
    np.testing.assert_allclose(k_ext, k[:, cut:], atol=1e-5 * scale, rtol=1e-5)
    np.testing.assert_allclose(v_ext, v[:, cut:], atol=1e-5 * scale, rtol=1e-5)
