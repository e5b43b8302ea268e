"""Language workloads: GPT-2 and LLaMA-2 models, tokenizers, token shards and their loaders."""
