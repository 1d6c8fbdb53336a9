"""The model description both engines share: its spec from a HF `config.json`, one module per family,
RoPE tables."""
