# ruff: noqa: F821
# (the undefined names come from moetron's model code, which `moetron export` writes above this part)
# ---------------------------------------------------------------------------- the transformers wrapper
# (appended by `moetron export` after moetron's own model code above; this file needs no moetron install)

import contextlib as _contextlib
import dataclasses as _dataclasses

from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moetron import MoetronConfig

# The output's cache field: `cache` in transformers 5, `past_key_values` before.
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


class _CacheAdapter:
    """A transformers cache seen through moetron's KVCache interface (`length`, `update`, `advance`)."""

    def __init__(self, cache):
        self.cache = cache
        self.length = cache.get_seq_length()

    def check_room(self, batch_size: int, new_tokens: int) -> None:
        pass

    def update(self, layer_index: int, k_BKTD, v_BKTD):
        return self.cache.update(k_BKTD, v_BKTD, layer_index)

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens


@_contextlib.contextmanager
def _inference_routing(model: GPTModel, num_tokens: int, mode: str):
    """ "eval": the routers' own eval-mode routing, except passes of fewer tokens than --moe-min-capacity (decode
    steps), which cannot drop anything and route dropless; "dropless": never drop."""
    routers = [moe.router for moe in model.moe_layers()]
    previous = [r.cfg for r in routers]
    base = model.cfg
    if mode == "dropless" or num_tokens < base.moe_min_capacity:
        cfg = _dataclasses.replace(base, moe_token_dropping=False, moe_min_capacity=0)
        for router in routers:
            router.cfg = cfg
    try:
        yield
    finally:
        for router, old in zip(routers, previous, strict=True):
            router.cfg = old


@_contextlib.contextmanager
def _random_streams(seed, training: bool, sample_index: int, past: int):
    """The forward's random draws (random token selection, top-2's sampled second expert, dropout) from moetron's
    seeded streams (`RandomStreams` above), keyed as `moetron eval` / the trainer key them: (run seed, phase, index of
    the batch's first dataset sample, layer). So a full forward of the same tokens gives `moetron eval`'s logits. A
    cached decode step (past > 0) gets a phase of its own per position. `seed` None (an export written before the
    seed was recorded): the global generator, as transformers models draw."""
    if seed is None:
        yield
        return
    previous = STREAMS.seed
    STREAMS.configure(int(seed))
    phase = ("train" if training else "valid") + (f"+{past}" if past else "")
    try:
        with STREAMS.micro_batch(phase, sample_index):
            yield
    finally:
        STREAMS.configure(previous)


class MoetronForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MoetronConfig
    base_model_prefix = "model"
    _no_split_modules = ["TransformerLayer"]
    _supports_cache_class = True

    def __init__(self, config: MoetronConfig):
        super().__init__(config)
        self.model = GPTModel(ModelConfig(**config.moetron))
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, Router):  # weights come from the checkpoint; the transient load counter is not saved
            module.load_since_update_E.zero_()

    def get_input_embeddings(self):
        return self.model.word_embeddings

    def set_input_embeddings(self, value):
        self.model.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, return_dict=None, cache=None, sample_index=0,
                **kwargs):  # fmt: skip
        """`sample_index`: the dataset index of the batch's first sequence (`moetron eval` keys its random routing
        draws by it; see `_random_streams`)."""
        if input_ids is None:
            raise ValueError("MoetronForCausalLM needs input_ids (inputs_embeds are not supported)")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("MoetronForCausalLM does not support padded batches (attention_mask with zeros): "
                             "batch prompts of one length, or run them one at a time")  # fmt: skip
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        cache = cache if cache is not None else past_key_values  # transformers 5 says `cache`, 4 `past_key_values`
        if use_cache and cache is None:
            cache = DynamicCache()
        adapter = _CacheAdapter(cache) if use_cache else None
        past = adapter.length if adapter is not None else 0
        seed = getattr(self.config, "random_seed", None)
        routing = _inference_routing(self.model, input_ids.numel(), self.config.inference_routing)
        with routing, _random_streams(seed, self.training, int(sample_index), past):
            out = self.model(input_ids, kv_cache=adapter)
        logits = out.logits[..., : self.config.vocab_size]
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].reshape(-1)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), shifted, ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
