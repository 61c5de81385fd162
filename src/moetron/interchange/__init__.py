"""Checkpoints that travel: Hugging Face export and import, Megatron-DeepSpeed import, upcycling.

    hf_export.export_hf(load, output, dtype)          moetron checkpoint → HF directory (a native transformers class
                                                      when one expresses the config, else trust_remote_code)
    hf_import.import_hf(hf_dir, save)                 HF directory → moetron checkpoint + config.yaml
    megatron_deepspeed.import_megatron_deepspeed(...) Megatron-DeepSpeed MoE checkpoint → moetron checkpoint
    upcycle.upcycle(...)                              dense checkpoint → MoE checkpoint whose experts copy the MLP

Files: `hf_architectures.py` (what each transformers class expresses, one `Architecture` each, built from the
rules of `hf_tensor_rules.py`), `moetron_checkpoint.py` (reads a checkpoint one tensor at a time),
`safetensors_stream.py` (writes shards one tensor at a time), `tokenizer_files.py`, `remote_code.py` (bundles
moetron's model code into `modeling_moetron.py`).
"""
