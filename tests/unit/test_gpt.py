"""GPTModel: every option combination, a hand-written reference GPT, losses, checkpointing, KV cache."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from moetron.errors import ConfigError, UserError
from moetron.model import GPTModel, KVCache, ModelConfig, create_model
from moetron.model.attention import fuse_qkv, split_qkv_weight
from moetron.model.loss import LogitsHeadLoss
from moetron.model.moe.stats import MoEStepRecord
from moetron.parallel.expert_bias import update_expert_biases

VOCAB = 50  # padded to 64 below


def tiny_cfg(**overrides) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=12)
    base.update(make_vocab_size_divisible_by=64, hidden_dropout=0.0, attention_dropout=0.0, ffn_hidden_size=48)
    base.update(overrides)
    return ModelConfig(**base)


MODERN = dict(
    normalization="rmsnorm",
    position_embedding_type="rope",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    num_key_value_heads=2,
)


def tokens(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- a plain reference GPT
def reference_logits(cfg: ModelConfig, sd: dict[str, torch.Tensor], tokens_BT: torch.Tensor) -> torch.Tensor:
    """Megatron's GPT written out longhand from the state dict (no moetron modules)."""
    B, T = tokens_BT.shape
    H, K, D = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    x = sd["word_embeddings.weight"][tokens_BT]
    if cfg.position_embedding_type == "learned_absolute":
        x = x + sd["position_embeddings.weight"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = ref_norm(cfg, sd, p + "input_layernorm", x)
        qkv_sd = {}  # the fused grouped layout as three separate projections
        for part in ("weight", "bias"):
            fused = sd.get(p + "self_attention.query_key_value." + part)
            if fused is not None:
                for proj, tensor in zip("qkv", split_qkv_weight(fused, H, K), strict=True):
                    qkv_sd[f"{proj}.{part}"] = tensor
        q = ref_linear(qkv_sd, "q", h).reshape(B, T, H, D).transpose(1, 2)
        k = ref_linear(qkv_sd, "k", h).reshape(B, T, K, D).transpose(1, 2).repeat_interleave(H // K, 1)
        v = ref_linear(qkv_sd, "v", h).reshape(B, T, K, D).transpose(1, 2).repeat_interleave(H // K, 1)
        if cfg.position_embedding_type == "rope":
            q, k = ref_rope(q, cfg.rotary_base), ref_rope(k, cfg.rotary_base)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)
        x = x + ref_linear(sd, p + "self_attention.dense", attn)
        h = ref_norm(cfg, sd, p + "post_attention_layernorm", x)
        up = ref_linear(sd, p + "mlp.dense_h_to_4h", h)
        if cfg.swiglu:
            act = up * torch.sigmoid(up) * ref_linear(sd, p + "mlp.dense_h_to_4h_up", h)
        else:
            act = 0.5 * up * (1 + torch.tanh(math.sqrt(2 / math.pi) * (up + 0.044715 * up**3)))
        x = x + ref_linear(sd, p + "mlp.dense_4h_to_h", act)
    x = ref_norm(cfg, sd, "final_layernorm", x)
    out = sd["output_layer.weight"] if cfg.untie_embeddings_and_output_weights else sd["word_embeddings.weight"]
    return x @ out.T


def ref_linear(sd, name, x):
    y = x @ sd[name + ".weight"].T
    return y + sd[name + ".bias"] if name + ".bias" in sd else y


def ref_norm(cfg, sd, name, x):
    if cfg.normalization == "rmsnorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * sd[name + ".weight"]
    mu, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
    return (x - mu) / torch.sqrt(var + cfg.layernorm_epsilon) * sd[name + ".weight"] + sd[name + ".bias"]


def ref_rope(x_BHTD, base):
    T, D = x_BHTD.shape[2], x_BHTD.shape[3]
    theta = torch.arange(T)[:, None] * base ** (-torch.arange(0, D, 2) / D)
    z = torch.complex(x_BHTD[..., : D // 2], x_BHTD[..., D // 2 :]) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("options", [{}, MODERN], ids=["megatron", "modern"])
def test_dense_model_equals_reference(options):
    cfg = tiny_cfg(**options)
    model = create_model(cfg, "cpu", seed=3).eval()
    with torch.no_grad():  # non-trivial norms and biases, activations outside GELU's near-linear region
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif "dense_h_to_4h" in name:
                p.normal_(0.0, 0.5)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    x = tokens()
    torch.testing.assert_close(model(x).logits, reference_logits(cfg, sd, x), atol=1e-4, rtol=1e-4)


def pairwise_covering_combinations() -> list[tuple[bool, ...]]:
    """Six on/off options: the L8 orthogonal array (every pair of options meets in all four states), plus all-on."""
    rows = [(a, b, a ^ b, c, a ^ c, b ^ c) for a, b, c in itertools.product([False, True], repeat=3)]
    return rows + [(True,) * 6]


def test_every_option_combination_runs_forward_and_backward():
    flags = ["normalization", "position_embedding_type", "swiglu", "add_bias_linear", "untie", "gqa"]
    combos = pairwise_covering_combinations()
    for first, second in itertools.combinations(range(len(flags)), 2):  # the design really covers every pair
        assert len({(c[first], c[second]) for c in combos}) == 4
    for combo in combos:
        on = dict(zip(flags, combo, strict=True))
        cfg = tiny_cfg(
            num_layers=1,
            normalization="rmsnorm" if on["normalization"] else "layernorm",
            position_embedding_type="rope" if on["position_embedding_type"] else "learned_absolute",
            swiglu=on["swiglu"],
            add_bias_linear=not on["add_bias_linear"],
            untie_embeddings_and_output_weights=on["untie"],
            num_key_value_heads=1 if on["gqa"] else None,
            hidden_dropout=0.1,
            attention_dropout=0.1,
        )
        model = create_model(cfg, "cpu", seed=0)
        x = tokens(2, 6)
        out = model(x, labels_BT=x)
        assert out.logits.shape == (2, 6, 64), on
        assert torch.isfinite(out.lm_loss) and out.moe_loss.item() == 0.0 and out.moe_aux == []
        out.lm_loss.backward()
        assert all(p.grad is not None for p in model.parameters()), on


def test_tied_embeddings_share_storage_and_padded_vocab():
    tied = create_model(tiny_cfg(), "cpu", seed=0)
    assert tied.output_layer is None
    assert tied.word_embeddings.weight.shape == (64, 32)  # 50 padded to a multiple of 64
    untied = create_model(tiny_cfg(untie_embeddings_and_output_weights=True), "cpu", seed=0)
    assert untied.output_layer.weight.data_ptr() != untied.word_embeddings.weight.data_ptr()
    x = tokens()
    out = tied(x, labels_BT=x)
    out.lm_loss.backward()
    # the LM head is the embedding: padded rows get gradient only through the softmax (pushed down)
    assert tied.word_embeddings.weight.grad[VOCAB:].abs().sum() > 0
    assert out.logits.shape[-1] == 64


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = create_model(tiny_cfg(num_key_value_heads=2), "cpu", seed=1).eval()
    mha = create_model(tiny_cfg(num_key_value_heads=4), "cpu", seed=2).eval()
    D, H, K = 8, 4, 2
    sd = gqa.state_dict()
    for name, value in sd.items():
        if "query_key_value" in name:  # repeat each K/V head for the 2 query heads of its group
            q, k, v = split_qkv_weight(value, H, K)
            rep = lambda t: t.unflatten(0, (K, D)).repeat_interleave(H // K, dim=0).flatten(0, 1)  # noqa: E731
            sd[name] = fuse_qkv(q, rep(k), rep(v), H, H)
    mha.load_state_dict(sd)
    x = tokens()
    torch.testing.assert_close(gqa(x).logits, mha(x).logits, atol=1e-5, rtol=1e-5)


def test_loss_is_masked_mean_of_fp32_cross_entropy():
    model = create_model(tiny_cfg(), "cpu", seed=0)
    x, labels = tokens(seed=1), tokens(seed=2)
    mask = (torch.rand(labels.shape, generator=torch.Generator().manual_seed(3)) > 0.5).float()
    out = model(x, labels_BT=labels, loss_mask_BT=mask)
    per_token = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="none")
    torch.testing.assert_close(out.lm_loss, (per_token * mask.flatten()).sum() / mask.sum())
    assert out.lm_loss.dtype == torch.float32
    zero = model(x, labels_BT=labels, loss_mask_BT=torch.zeros_like(mask))
    assert zero.lm_loss.item() == 0.0
    assert model(x, labels_BT=labels, return_logits=False).logits is None


def test_forward_computes_the_callers_head_loss():
    """The model decides nothing for a caller that names its head loss (the parallel model's, e.g. vocab-parallel):
    its loss function reads the logits the forward built, once."""
    model = create_model(tiny_cfg(), "cpu", seed=0)
    x, labels = tokens(seed=1), tokens(seed=2)
    seen = []

    def loss_fn(logits_BTV, labels_BT, loss_mask_BT=None):
        seen.append(logits_BTV)
        return logits_BTV.float().mean()

    out = model(x, labels_BT=labels, head_loss=LogitsHeadLoss(loss_fn))
    assert len(seen) == 1 and seen[0] is out.logits
    assert out.lm_loss == out.logits.float().mean()
    fused = model(x, labels_BT=labels, return_logits=False)  # a plain model's own choice: the fused head
    torch.testing.assert_close(fused.lm_loss, model(x, labels_BT=labels).lm_loss, atol=1e-6, rtol=0)


def test_autocast_bf16_keeps_fp32_loss():
    model = create_model(tiny_cfg(**MODERN), "cpu", seed=0)
    x = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, labels_BT=x)
    assert out.logits.dtype == torch.bfloat16 and out.lm_loss.dtype == torch.float32
    out.lm_loss.backward()
    assert torch.isfinite(out.lm_loss)


@pytest.mark.parametrize("options", [{}, MODERN], ids=["megatron", "modern"])
def test_activation_checkpointing_gives_identical_loss_and_grads(options):
    """With dropout on: checkpoint restores the RNG, so recomputation draws the same masks."""

    def loss_and_grads(checkpointing: bool):
        cfg = tiny_cfg(checkpoint_activations=checkpointing, hidden_dropout=0.2, attention_dropout=0.2, **options)
        model = create_model(cfg, "cpu", seed=5)
        torch.manual_seed(11)
        out = model(tokens(), labels_BT=tokens(seed=1))
        out.lm_loss.backward()
        return out.lm_loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss, grads = loss_and_grads(False)
    loss_ckpt, grads_ckpt = loss_and_grads(True)
    torch.testing.assert_close(loss, loss_ckpt, atol=0, rtol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ckpt[name], atol=1e-6, rtol=1e-5, msg=name)


def greedy_decode(model: GPTModel, prompt: torch.Tensor, steps: int, use_cache: bool) -> torch.Tensor:
    seq = prompt
    cache = KVCache.for_model(model.cfg, prompt.shape[0], max_length=prompt.shape[1] + steps) if use_cache else None
    step_input = prompt
    for _ in range(steps):
        logits = model(step_input if use_cache else seq, kv_cache=cache).logits
        next_token = logits[:, -1, :VOCAB].argmax(-1, keepdim=True)
        seq = torch.cat([seq, next_token], dim=1)
        step_input = next_token
    return seq


@pytest.mark.parametrize("options", [{}, MODERN], ids=["megatron", "modern"])
def test_kv_cache_greedy_decode_equals_uncached(options):
    model = create_model(tiny_cfg(**options), "cpu", seed=7).eval()
    prompt = tokens(2, 4)
    with torch.no_grad():
        cached = greedy_decode(model, prompt, 8, use_cache=True)
        plain = greedy_decode(model, prompt, 8, use_cache=False)
        assert torch.equal(cached, plain)
        cache = KVCache.for_model(model.cfg, 2)
        model(cached[:, :5], kv_cache=cache)
        stepped = model(cached[:, 5:], kv_cache=cache).logits  # a multi-token chunk after a prefill
        torch.testing.assert_close(stepped, model(cached).logits[:, 5:], atol=1e-5, rtol=1e-5)
        assert cache.length == 12


def test_learned_positions_refuse_sequences_past_the_table():
    model = create_model(tiny_cfg(), "cpu", seed=0)
    with pytest.raises(UserError, match="max-position-embeddings 12"):
        model(tokens(1, 13))


def test_bad_config_is_one_clear_error():
    with pytest.raises(ConfigError, match="--num-attention-heads 4 is not divisible by --num-key-value-heads 3"):
        GPTModel(tiny_cfg(num_key_value_heads=3))


def test_meta_build_then_materialise():
    with torch.device("meta"):
        model = GPTModel(tiny_cfg(**MODERN))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    assert torch.isfinite(model(tokens()).logits).all()


# ---------------------------------------------------------------------- MoE integration
MOE = dict(num_layers=4, num_experts=[4, 8], topk=2, moe_loss_coeff=0.01)


def test_moe_layers_are_placed_and_their_losses_collected():
    cfg = tiny_cfg(**MOE, moe_z_loss_coeff=0.001)
    model = create_model(cfg, "cpu", seed=0)
    assert [layer.is_moe for layer in model.layers.values()] == [False, True, False, True]
    assert [moe.num_experts for moe in model.moe_layers()] == [4, 8]
    out = model(tokens(), labels_BT=tokens(seed=1))
    assert len(out.moe_aux) == 2
    expected = sum(0.01 * aux.aux_loss + 0.001 * aux.z_loss for aux in out.moe_aux)
    torch.testing.assert_close(out.moe_loss, expected)
    assert out.moe_loss.dtype == torch.float32 and out.moe_loss.item() > 0
    (out.lm_loss + out.moe_loss).backward()
    assert all(moe.router.weight.grad.abs().sum() > 0 for moe in model.moe_layers())


@pytest.mark.parametrize("topk", [1, 2])
def test_checkpointing_replays_the_routers_random_draws(topk):
    """RTS (top-1) and the Gumbel second choice (top-2) draw random numbers; recomputation must see the same."""
    options = dict(MOE, topk=topk, moe_use_rts=True, moe_train_capacity_factor=0.5, moe_min_capacity=0)

    def loss_and_grads(checkpointing: bool):
        model = create_model(tiny_cfg(checkpoint_activations=checkpointing, **options), "cpu", seed=4)
        torch.manual_seed(21)
        out = model(tokens(), labels_BT=tokens(seed=1))
        (out.lm_loss + out.moe_loss).backward()
        dropped = sum(int(aux.dropped_routes) for aux in out.moe_aux)
        return out.lm_loss.detach(), out.moe_loss.detach(), dropped, {n: p.grad for n, p in model.named_parameters()}

    loss, moe_loss, dropped, grads = loss_and_grads(False)
    loss_ckpt, moe_loss_ckpt, _, grads_ckpt = loss_and_grads(True)
    assert dropped > 0  # capacity is tight enough that the random selection matters
    torch.testing.assert_close((loss, moe_loss), (loss_ckpt, moe_loss_ckpt), atol=0, rtol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ckpt[name], atol=1e-6, rtol=1e-5, msg=name)


def test_checkpointing_counts_each_layers_routing_statistics_once():
    """The backward's recomputation of a checkpointed MoE layer adds no statistics of its own (`recompute_contexts`)."""
    counts = {}
    for checkpointing in (False, True):
        model = create_model(tiny_cfg(checkpoint_activations=checkpointing, **MOE), "cpu", seed=4)
        record = MoEStepRecord.attached_to(model.moe_layers())
        out = model(tokens(), labels_BT=tokens(seed=1))
        (out.lm_loss + out.moe_loss).backward()
        counts[checkpointing] = [record.forwards[moe.layer_index] for moe in model.moe_layers()]
    assert counts[True] == counts[False] == [1] * len(counts[False])


def test_moe_kv_cache_decode_equals_uncached_with_dropless_routing():
    cfg = tiny_cfg(**MOE, moe_eval_capacity_factor=0.5, moe_min_capacity=0, moe_use_rts=False)
    model = create_model(cfg, "cpu", seed=8).eval()
    prompt = tokens(2, 4)
    with torch.no_grad(), model.inference_routing(dropless=True):
        assert all(not moe.router.cfg.moe_token_dropping for moe in model.moe_layers())
        assert sum(int(aux.dropped_routes) for aux in model(prompt).moe_aux) == 0
        cached = greedy_decode(model, prompt, 8, use_cache=True)
        plain = greedy_decode(model, prompt, 8, use_cache=False)
    assert torch.equal(cached, plain)
    assert all(moe.router.cfg.moe_token_dropping for moe in model.moe_layers())  # restored
    model.set_inference_routing(dropless=True)
    assert not model.moe_layers()[0].router.cfg.moe_token_dropping
    model.set_inference_routing(dropless=False)
    assert model.moe_layers()[0].router.cfg.moe_token_dropping


def test_update_expert_biases_moves_every_router():
    model = create_model(tiny_cfg(**MOE, moe_router_bias_update_rate=0.1), "cpu", seed=0)
    model(tokens(4, 12))
    update_expert_biases(model, step_applied=True)
    for moe in model.moe_layers():
        assert moe.router.expert_bias.abs().sum() > 0
        assert moe.router.load_since_update_E.sum() == 0


def test_a_skipped_step_forgets_its_router_loads_without_moving_the_biases():
    model = create_model(tiny_cfg(**MOE, moe_router_bias_update_rate=0.1), "cpu", seed=0)
    model(tokens(4, 12))
    assert all(moe.router.load_since_update_E.sum() > 0 for moe in model.moe_layers())
    update_expert_biases(model, step_applied=False)
    for moe in model.moe_layers():
        assert moe.router.expert_bias.abs().sum() == 0
        assert moe.router.load_since_update_E.sum() == 0


def test_tiny_moe_gpt_overfits_a_batch():
    cfg = tiny_cfg(num_experts=[4], topk=2, seq_length=16, moe_loss_coeff=0.01)
    model = create_model(cfg, "cpu", seed=0)
    batch = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(300):
        out = model(batch[:, :-1], labels_BT=batch[:, 1:])
        (out.lm_loss + out.moe_loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.lm_loss.item())
        if losses[-1] < 0.1 * losses[0]:
            break
    assert losses[-1] < 0.1 * losses[0], losses[::20]


# ---------------------------------------------------------------------- equality with Hugging Face models
def perturbed_norms(model: torch.nn.Module) -> None:
    """Non-trivial norms, and weights large enough that activations leave GELU's near-linear region
    (with std 0.02 the tanh and erf GELUs would agree within the tolerance)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "mlp.c_fc" in name:
                p.normal_(0.0, 0.5)


def test_megatron_default_model_equals_hf_gpt2():
    """Megatron's GPT (LayerNorm, learned positions, tanh-GELU MLP with biases, tied head) is GPT-2."""
    transformers = pytest.importorskip("transformers", reason="optional: checks equality with HF GPT-2")
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=64, n_positions=12, n_embd=32, n_layer=2, n_head=4, n_inner=48)
    hf_cfg.resid_pdrop = hf_cfg.embd_pdrop = hf_cfg.attn_pdrop = 0.0
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    perturbed_norms(hf)
    sd = {"word_embeddings.weight": hf.transformer.wte.weight, "position_embeddings.weight": hf.transformer.wpe.weight}
    sd |= {"final_layernorm.weight": hf.transformer.ln_f.weight, "final_layernorm.bias": hf.transformer.ln_f.bias}
    for i, block in enumerate(hf.transformer.h):
        pairs = {
            "input_layernorm": block.ln_1,
            "self_attention.query_key_value": block.attn.c_attn,
            "self_attention.dense": block.attn.c_proj,
            "post_attention_layernorm": block.ln_2,
            "mlp.dense_h_to_4h": block.mlp.c_fc,
            "mlp.dense_4h_to_h": block.mlp.c_proj,
        }
        for ours, theirs in pairs.items():  # HF's Conv1D stores [in, out]: transpose to nn.Linear's [out, in]
            weight, bias = (theirs.weight if "layernorm" in ours else theirs.weight.T), theirs.bias
            if ours.endswith("query_key_value"):  # GPT-2's [Q | K | V] thirds → our grouped layout (K = H)
                weight, bias = (fuse_qkv(*t.chunk(3), hf_cfg.n_head, hf_cfg.n_head) for t in (weight, bias))
            sd |= {f"layers.{i}.{ours}.weight": weight, f"layers.{i}.{ours}.bias": bias}
    model = GPTModel(tiny_cfg()).eval()
    model.load_state_dict({k: v.detach().clone() for k, v in sd.items()})
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, hf(x).logits, atol=1e-5, rtol=1e-4)


MIXTRAL = dict(
    MODERN,
    vocab_size=64,
    rotary_base=1e6,
    ffn_hidden_size=16,
    num_experts=[4],
    expert_interval=1,
    topk=2,
    moe_token_dropping=False,
    moe_top2_2nd_expert_sampling=False,
)


def hf_mixtral_experts(experts: torch.nn.Module, ffn: int) -> dict[str, torch.Tensor]:
    """Our [E, …] expert tensors from HF Mixtral's experts (fused in transformers >= 5, a list before)."""
    if hasattr(experts, "gate_up_proj"):  # [E, 2F, D] = [gate | up] along dim 1; down [E, D, F]
        gate_up = experts.gate_up_proj
        w1, w3, w2 = gate_up[:, :ffn], gate_up[:, ffn:], experts.down_proj
    else:  # ModuleList of MixtralBlockSparseTop2MLP(w1, w2, w3) nn.Linears
        w1, w3, w2 = (torch.stack([getattr(e, n).weight for e in experts]) for n in ("w1", "w3", "w2"))
    return {"w1_EDF": w1.transpose(1, 2), "w3_EDF": w3.transpose(1, 2), "w2_EFD": w2.transpose(1, 2)}


def hf_mixtral_model(transformers) -> torch.nn.Module:
    """A tiny HF MixtralForCausalLM (eval mode, perturbed norms): 2 layers, 4 experts top-2, GQA 4/2, vocab 64."""
    torch.manual_seed(0)
    hf_cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=12,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
    )
    hf_cfg._attn_implementation = "eager"
    hf = transformers.MixtralForCausalLM(hf_cfg).eval()
    perturbed_norms(hf)
    return hf


def moetron_state_from_hf_mixtral(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF Mixtral's weights under moetron's parameter names."""
    F_ = hf.config.intermediate_size
    heads, kv_heads = hf.config.num_attention_heads, hf.config.num_key_value_heads
    sd = {
        "word_embeddings.weight": hf.model.embed_tokens.weight,
        "output_layer.weight": hf.lm_head.weight,
        "final_layernorm.weight": hf.model.norm.weight,
    }
    for i, layer in enumerate(hf.model.layers):
        attn, moe, p = layer.self_attn, getattr(layer, "mlp", None) or layer.block_sparse_moe, f"layers.{i}."
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        sd[p + "self_attention.query_key_value.weight"] = fuse_qkv(
            attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, heads, kv_heads
        )
        sd[p + "self_attention.dense.weight"] = attn.o_proj.weight
        sd[p + "mlp.router.weight"] = moe.gate.weight
        sd |= {p + "mlp.experts." + k: v for k, v in hf_mixtral_experts(moe.experts, F_).items()}
    return {k: v.detach().clone() for k, v in sd.items()}


def test_modern_options_express_hf_mixtral_exactly():
    """RMSNorm + RoPE + GQA + SwiGLU experts, no biases, untied head, softmax-top-2-renormalised dropless routing."""
    transformers = pytest.importorskip("transformers", reason="optional: checks equality with HF Mixtral")
    hf = hf_mixtral_model(transformers)
    model = create_model(tiny_cfg(**MIXTRAL), "cpu", seed=0).eval()
    missing, unexpected = model.load_state_dict(moetron_state_from_hf_mixtral(hf), strict=False)
    assert not unexpected and all(name.endswith("router.expert_bias") for name in missing), missing
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, hf(x).logits, atol=1e-5, rtol=1e-4)
