"""A tiny causal language model for the tests: a byte-level BPE tokenizer of 300 tokens trained
on the given texts and a randomly initialized 2-layer Llama (hidden size 32), saved as a Hugging
Face folder; ``model = hf:<folder>`` loads it exactly as it would a pretrained one."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch


def write_tiny_lm(folder: Path, texts: Iterable[str], vocabulary: int = 300,
                  model_vocabulary: int | None = None) -> Path:
    """The folder, with a tokenizer of ``vocabulary`` tokens and a model embedding
    ``model_vocabulary`` of them (default: all)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(list(texts), trainers.BpeTrainer(
        vocab_size=vocabulary, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(folder)
    config = LlamaConfig(vocab_size=model_vocabulary or len(fast), hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    return folder
