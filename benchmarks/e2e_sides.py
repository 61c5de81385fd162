"""The trainers `benchmarks/e2e.py` compares: moetron and its peers, each one optimizer step per `step()` call.

Every side trains on the same pre-built batches (`[B, T+1]` token rows: inputs `[:, :-1]`, next-token labels
`[:, 1:]`) with AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on ≥2-D tensors), gradient clipping at 1.0, fp32,
no dropout. Peers run their own code, as their users would:
  nanogpt            karpathy/nanoGPT's `model.py` (GPT, `model(X, Y)` → loss), imported from `--nanogpt-dir`
                     (fetched as-is outside the repository), its train.py loop (backward, clip, step,
                     zero_grad(set_to_none=True)).
  hf-mixtral         transformers' `MixtralForCausalLM` (SDPA attention, grouped_mm experts), `model(x, labels)`
                     with the labels already shifted (`shift_labels`), so it sees the same T predictions.
  nanogpt-deepspeed  nanoGPT's GPT whose every 2nd block's MLP is `deepspeed.moe.layer.MoE` (top-1, capacity
                     factor 1.0, min capacity 4, random token selection, 8 copies of nanoGPT's MLP as experts; a
                     1-process gloo group), loss + 0.01 · Σ l_aux (Megatron-DeepSpeed's moe-loss-coeff).
  moetron            `moetron.train.Trainer.train_step()` on a config given as `moetron train` flags.
Where the two models are the same function (dense: nanoGPT's GELU set to the tanh form, GPT-2's `gelu_new`, which
moetron uses — the same cost; mixtral: HF trains without the load-balancing loss, so moetron runs with
`--moe-loss-coeff 0`), moetron starts from the peer's initial weights (converted with moetron's Hugging Face
interchange rules), so their losses after the same steps must agree. DeepSpeed-MoE's random token selection draws
from its own generator, so that pair starts from its own seeds and its losses only track each other.
The peers' AdamW is fused (`fused=True`, as moetron's) unless `peer_adamw == "default"` (nanoGPT's own choice is
fused only on CUDA; HF's is foreach).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from moetron.config_cli import add_config_arguments, cli_overrides, load_config
from train_step import ListLoader  # moetron's loader interface over pre-built batches

LR, BETAS, WEIGHT_DECAY, CLIP = 6e-4, (0.9, 0.95), 0.1, 1.0
HIDDEN, LAYERS, HEADS, SEQ, BATCH, VOCAB = 128, 4, 4, 64, 12, 50304
TRAIN_FLAGS = (
    f"--lr {LR} --lr-decay-style constant --adam-beta1 {BETAS[0]} --adam-beta2 {BETAS[1]} "
    f"--weight-decay {WEIGHT_DECAY} --clip-grad {CLIP} --micro-batch-size {BATCH} --train-iters 100000 "
    "--log-interval 1000000 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0"
)
GPT_FLAGS = f"--num-layers {LAYERS} --hidden-size {HIDDEN} --num-attention-heads {HEADS} --seq-length {SEQ}"
# README "Model options": exactly Mixtral (RMSNorm, RoPE, SwiGLU experts, untied head, dropless top-2, no sampling)
MIXTRAL_FLAGS = (
    "--normalization rmsnorm --position-embedding-type rope --rotary-base 1e6 --swiglu --no-add-bias-linear "
    "--untie-embeddings-and-output-weights --num-experts 8 --expert-interval 1 --topk 2 "
    "--disable-moe-token-dropping --disable-moe-top2-2nd-expert-sampling --moe-loss-coeff 0"
)
MIXTRAL_SHAPE = "--ffn-hidden-size 256 --num-key-value-heads 2"
DEEPSPEED_FLAGS = "--num-experts 8 --expert-interval 2 --topk 1 --moe-train-capacity-factor 1.0 --moe-min-capacity 4"

MOETRON_FLAGS = {
    "dense": f"{GPT_FLAGS} {TRAIN_FLAGS}",
    "mixtral": f"{GPT_FLAGS} {MIXTRAL_FLAGS} {MIXTRAL_SHAPE} {TRAIN_FLAGS}",
    "deepspeed": f"{GPT_FLAGS} {DEEPSPEED_FLAGS} {TRAIN_FLAGS}",
}
PEERS = {"dense": "nanogpt", "mixtral": "hf-mixtral", "deepspeed": "nanogpt-deepspeed"}


@dataclass
class Side:
    """One trainer: `step(batch_B_T1)` runs one optimizer step and returns the loss (a 0-dim tensor)."""

    name: str
    step: object
    model: nn.Module
    optimizer: torch.optim.Optimizer
    notes: list[str] = field(default_factory=list)
    cfg: object = None  # moetron's RunConfig

    def parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())

    def resident_bytes(self) -> int:
        """Parameters and optimizer state: what is live between steps (gradients are set to None)."""
        tensors = {id(p): p for p in self.model.parameters()}
        for state in self.optimizer.state.values():
            tensors.update({id(t): t for t in state.values() if torch.is_tensor(t)})
        return sum(t.numel() * t.element_size() for t in tensors.values())


def decay_groups(model: nn.Module) -> list[dict]:
    """nanoGPT's rule (also moetron's): weight decay on ≥2-D tensors only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def peer_optimizer(model: nn.Module, peer_adamw: str) -> torch.optim.Optimizer:
    extra = {"fused": True} if peer_adamw == "fused" else {}
    return torch.optim.AdamW(decay_groups(model), lr=LR, betas=BETAS, **extra)


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_of):
    """nanoGPT's train.py iteration (one micro-step, fp32): forward, backward, clip, step, zero_grad."""

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = loss_of(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())  # as get_batch makes them
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


# ---------------------------------------------------------------- moetron
def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` (moetron names) into `model`'s parameters, whatever compile wrappers the names carry."""
    params = {name.replace("_orig_mod.", ""): p for name, p in model.named_parameters(remove_duplicate=False)}
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise RuntimeError(f"peer weights lack {missing[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])


def peer_initial_weights(comparison: str, cfg, args) -> dict[str, torch.Tensor] | None:
    """The peer's initial weights in moetron's names (dense, mixtral), built here from the peer's own seed."""
    from moetron.interchange.hf_architectures import find_architecture

    arch = find_architecture(cfg.model)
    if comparison == "dense" and args.nanogpt_dir:
        state = nanogpt_model(args.nanogpt_dir).state_dict()
        # nanoGPT's nn.Linear is [out, in]; GPT-2's Conv1D (what the rules read) is [in, out]
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        hf = {k: v.t() if k.endswith(conv1d) else v for k, v in state.items()}
        return {rule.moetron: rule.to_moetron([hf[n] for n in rule.hf]) for rule in arch.rules(cfg.model)}
    if comparison == "mixtral":
        from moetron.interchange.hf_import import convert_tensors
        from moetron.interchange.safetensors_stream import HFWeights

        with tempfile.TemporaryDirectory(prefix="moetron-e2e-hf-") as tmp:
            hf_mixtral_side("fused", False).model.save_pretrained(tmp)  # the checkpoint layout the rules read
            return convert_tensors(HFWeights(Path(tmp)), arch.rules(cfg.model), cfg.model, "hf-mixtral")
    return None


def moetron_side(comparison: str, batches: list[torch.Tensor], args, extra_flags: str = "") -> Side:
    from moetron.parallel.env import DistEnv
    from moetron.parallel.mesh import ParallelMesh
    from moetron.parallel.parallelize import build
    from moetron.train.trainer import Trainer

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = f"{MOETRON_FLAGS[comparison]} {extra_flags}".split()
    cfg, _ = load_config(None, cli_overrides(parser.parse_args(flags)))
    base, _ = load_config(None, cli_overrides(parser.parse_args(MOETRON_FLAGS[comparison].split())))
    # the peer's weights only fit the model the comparison defines (extra flags may change it)
    weights = peer_initial_weights(comparison, cfg, args) if cfg.model == base.model else None
    env = DistEnv()
    mesh = ParallelMesh.build(cfg.dims(1), env)
    parallel = build(cfg, mesh, env.device)
    model = parallel.model
    notes = [f"moetron train {' '.join(flags)}"]
    if weights is not None:
        load_weights(model, weights)
        notes.append(f"moetron starts from {PEERS[comparison]}'s initial weights (identical models)")
    loader = ListLoader(batches)
    trainer = Trainer(cfg, env, parallel, loader)
    trainer.model.train()

    def step(batch: torch.Tensor) -> torch.Tensor:
        return trainer.train_step().sums.losses[0]  # the loader already holds the same batches, in order

    return Side("moetron", step, trainer.model, trainer.optimizer, notes, cfg)


# ---------------------------------------------------------------- nanoGPT (and DeepSpeed-MoE inside it)
def nanogpt_model(nanogpt_dir: str) -> nn.Module:
    sys.path.insert(0, nanogpt_dir)
    from model import GPT, GPTConfig  # karpathy/nanoGPT's model.py

    torch.manual_seed(1337)
    config = GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS, n_embd=HIDDEN, dropout=0.0)
    model = GPT(config)
    for block in model.transformer.h:
        block.mlp.gelu = nn.GELU(approximate="tanh")  # GPT-2's gelu_new, moetron's GELU: the same function
    return model


def compiled(model: nn.Module, on: bool):
    """What the peer's forward runs through: nanoGPT's train.py `torch.compile(model)` when asked."""
    return torch.compile(model) if on else model


def nanogpt_side(nanogpt_dir: str, peer_adamw: str, compile_model: bool) -> Side:
    model = nanogpt_model(nanogpt_dir)
    optimizer = peer_optimizer(model, peer_adamw)
    forward = compiled(model, compile_model)
    return Side("nanogpt", plain_step(model, optimizer, lambda x, y: forward(x, y)[1]), model, optimizer)


class DeepSpeedMoEMLP(nn.Module):
    """DeepSpeed's MoE layer in place of a nanoGPT block's MLP; its l_aux goes to the shared list."""

    def __init__(self, mlp: nn.Module, aux: list):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.aux = aux
        self.moe = MoE(HIDDEN, mlp, num_experts=8, ep_size=1, k=1, capacity_factor=1.0, eval_capacity_factor=1.0)
        self.moe.deepspeed_moe.gate.min_capacity = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, l_aux, _ = self.moe(x)
        self.aux.append(l_aux)
        return y


def nanogpt_deepspeed_side(nanogpt_dir: str, peer_adamw: str, port: int, compile_model: bool) -> Side:
    import deepspeed

    deepspeed.init_distributed(
        dist_backend="gloo", auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    model = nanogpt_model(nanogpt_dir)
    aux: list[torch.Tensor] = []
    for i, block in enumerate(model.transformer.h):
        if (i + 1) % 2 == 0:  # Megatron's expert interval 2: layers 2 and 4 (1-based)
            block.mlp = DeepSpeedMoEMLP(block.mlp, aux)
    optimizer = peer_optimizer(model, peer_adamw)
    forward = compiled(model, compile_model)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        aux.clear()
        loss = forward(x, y)[1]
        return loss + 0.01 * sum(aux)

    return Side("nanogpt-deepspeed", plain_step(model, optimizer, loss_of), model, optimizer)


# ---------------------------------------------------------------- Hugging Face Mixtral
def hf_mixtral_side(peer_adamw: str, compile_model: bool) -> Side:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
        rope_theta=1e6,
        router_jitter_noise=0.0,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(1337)
    model = MixtralForCausalLM(config).train()
    optimizer = peer_optimizer(model, peer_adamw)
    forward = compiled(model, compile_model)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return forward(input_ids=x, labels=y, shift_labels=y).loss

    return Side("hf-mixtral", plain_step(model, optimizer, loss_of), model, optimizer)


def build_side(name: str, comparison: str, batches: list[torch.Tensor], args) -> Side:
    if name == "moetron":
        return moetron_side(comparison, batches, args, args.moetron_flags)
    if name == "nanogpt":
        return nanogpt_side(args.nanogpt_dir, args.peer_adamw, args.peer_compile)
    if name == "nanogpt-deepspeed":
        return nanogpt_deepspeed_side(args.nanogpt_dir, args.peer_adamw, args.port, args.peer_compile)
    if name == "hf-mixtral":
        return hf_mixtral_side(args.peer_adamw, args.peer_compile)
    raise ValueError(name)
