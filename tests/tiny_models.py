"""Tiny random models of every supported family, saved as real HF folders.

The tokenizer is a byte-level BPE trained offline on the packaged demo conversation and wrapped
as a `PreTrainedTokenizerFast` with a ChatML template, so the real loading code runs end to end.
"""

from __future__ import annotations

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from inferscale.evaluation.datasets import load_demo

    demo = load_demo()
    corpus = [t.render() for t in demo.conversation.turns] + [f.text for f in demo.conversation.facts]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def make_tiny_model(path, family: str, *, seed: int = 0, num_layers: int = 2, head_dim: int = 32,
                    tie: bool = True, **overrides):
    """Save a tiny random model of `family` (+ tokenizer) to `path`; return the HF torch model."""
    import torch
    import transformers as tf

    tokenizer = _train_tokenizer(path)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
           "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
           "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM)}[family]
    kw = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=1024,
              tie_word_embeddings=tie, rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id,
              bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    if family == "llama":
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    if family == "gemma3_text":  # a sliding layer then a global one, a window shorter than the prompts,
        # per-layer RoPE (linear scaling on the global base), a query scale != head_dim ** -0.5
        kw.update(layer_types=["sliding_attention", "full_attention"] * (num_layers // 2) + ["sliding_attention"]
                  * (num_layers % 2), sliding_window=24, query_pre_attn_scalar=20, final_logit_softcapping=30.0,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    kw.update(overrides)
    if family == "phi3":  # as Phi-4-mini: fused qkv / gate-up, partial rotary 0.75, LongRoPE whose original
        # context is the served one (max_position_embeddings 4x it, so its attention factor is not 1)
        original, pairs = kw["max_position_embeddings"], int(head_dim * 0.75) // 2
        factors = __import__("numpy").random.default_rng(seed).uniform(1.0, 3.0, (2, pairs)).round(3).tolist()
        kw.update(max_position_embeddings=4 * original, original_max_position_embeddings=original,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                   "short_factor": factors[0], "long_factor": factors[1],
                                   "original_max_position_embeddings": original})
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kw)).eval()
    with torch.no_grad():  # larger weights than the default init so logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif family == "gemma3_text":  # Gemma's norms start at 0 (scale 1 + w): make them matter
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model
