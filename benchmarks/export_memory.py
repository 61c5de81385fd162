"""Peak memory of `moetron export` (streamed, one tensor at a time) against a whole-model conversion, side by side.

    PYTHONPATH=src python benchmarks/export_memory.py [--hidden 256 --experts 8 --layers 4]

Both convert the same moetron checkpoint (a Mixtral-style MoE) to the same Hugging Face safetensors. Baseline: what a
converter without streaming does — load the whole model (`load_weights`), build the HF state dict, `save_file` it.
Measured: torch's CPU allocator peak (allocated − freed bytes, `memory_peak.peak_cpu_bytes`) during each, printed with
the model's and its largest tensor's size; the outputs are checked to hold identical tensors.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from memory_peak import peak_cpu_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from interchange_support import ARCHITECTURES, run_config, save_model  # noqa: E402

from moetron.checkpoint import load_weights, resolve_checkpoint  # noqa: E402
from moetron.data.tokenizer import train_bpe_tokenizer  # noqa: E402
from moetron.interchange.hf_architectures import MIXTRAL  # noqa: E402
from moetron.interchange.hf_export import export_hf  # noqa: E402
from moetron.model.gpt import GPTModel, create_model  # noqa: E402


def whole_model_conversion(run: Path, cfg, out: Path) -> None:
    with torch.device("meta"):
        model = GPTModel(cfg.model)
    model.to_empty(device="cpu")
    load_weights(resolve_checkpoint(str(run)), model)
    state = model.state_dict()
    tensors = {}
    for rule in MIXTRAL.rules(cfg.model):
        tensors.update(zip(rule.hf, (t.contiguous() for t in rule.to_hf(state[rule.moetron])), strict=True))
    save_file(tensors, str(out / "model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "corpus.txt"
        corpus.write_text("\n\n".join(f"expert {i} routes token {i * 7}" for i in range(2000)))
        tok = train_bpe_tokenizer([corpus], args.vocab_size, root / "tok")
        model_cfg = dict(
            ARCHITECTURES["mixtral"],
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=8,
            num_key_value_heads=4,
            ffn_hidden_size=4 * args.hidden,
            moe_ffn_hidden_size=4 * args.hidden,
            num_experts=[args.experts],
        )
        cfg = run_config(tok, **model_cfg)
        cfg.model.vocab_size = args.vocab_size
        model = create_model(cfg.model, "cpu", seed=0)
        sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
        save_model(root / "run", cfg, model)
        del model
        (root / "baseline").mkdir()
        baseline = peak_cpu_bytes(lambda: whole_model_conversion(root / "run", cfg, root / "baseline"))
        streamed = peak_cpu_bytes(lambda: export_hf(str(root / "run"), str(root / "hf")))
        ours = {k: v for f in sorted((root / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
        theirs = load_file(root / "baseline" / "model.safetensors")
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    mb = 1 / 2**20
    print(f"model {sum(sizes) * mb:.1f} MB fp32, largest tensor {max(sizes) * mb:.1f} MB, {len(ours)} HF tensors")
    print(f"whole-model conversion peak: {baseline * mb:8.1f} MB  1.00x")
    print(
        f"moetron export peak:         {streamed * mb:8.1f} MB  {streamed / baseline:.2f}x "
        f"({streamed / max(sizes):.1f}x the largest tensor)"
    )


if __name__ == "__main__":
    main()
