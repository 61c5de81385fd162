"""The transformers config of a moetron model exported with remote code (written by `moetron export`).

`moetron` holds the model's moetron `ModelConfig` fields verbatim (Megatron flag names); the standard transformers
attributes are read off it so generic tools (generation, lm-eval's `hf` model) find what they look for.
`inference_routing`: "eval" routes as moetron's eval mode does (the eval capacity factor when the model drops
tokens; forward passes of fewer tokens than --moe-min-capacity route dropless, as `moetron generate` does), or
"dropless".
`random_seed`: the run's --seed; random routing in the forward (random token selection, top-2's sampled second
expert) draws from moetron's streams seeded by it and keyed by the batch's first sample index (the forward's
`sample_index`, default 0), so the logits equal `moetron eval`'s on the same tokens. None: torch's global generator.
"""

from transformers import PretrainedConfig


class MoetronConfig(PretrainedConfig):
    model_type = "moetron"

    def __init__(
        self, moetron: dict | None = None, inference_routing: str = "eval", random_seed: int | None = None, **kwargs
    ):
        self.moetron = dict(moetron or {})
        self.inference_routing = inference_routing
        self.random_seed = random_seed
        m = self.moetron
        heads = m.get("num_attention_heads", 1)
        kwargs.setdefault("vocab_size", m.get("vocab_size"))
        kwargs.setdefault("hidden_size", m.get("hidden_size"))
        kwargs.setdefault("num_hidden_layers", m.get("num_layers"))
        kwargs.setdefault("num_attention_heads", heads)
        kwargs.setdefault("num_key_value_heads", m.get("num_key_value_heads") or heads)
        kwargs.setdefault("max_position_embeddings", m.get("max_position_embeddings") or m.get("seq_length"))
        kwargs.setdefault("use_cache", True)
        kwargs["tie_word_embeddings"] = False  # the moetron model ties (or not) its own output layer
        super().__init__(**kwargs)
