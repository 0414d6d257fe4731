"""Tiny random causal LMs with real tokenizers and chat templates, built offline in well under
a second.

Each tokenizer is a byte-level BPE trained in memory on a small built-in English and Python
corpus, so any text round-trips. The two families use different chat templates (ChatML and a
Gemma-style one) and different special tokens, so code that hard-codes a separator fails here.
Weights are random but seeded: the same call always gives the same model.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. A small model can still learn a lot.",
    "Speculative decoding drafts a few tokens with a cheap model and verifies them at once.",
    "The target model accepts each draft token with probability min(1, p / q).",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about?",
    "Please write a short story about a robot who learns to paint the sea at night.",
    "Summarize the following paragraph in one sentence, then list three key points.",
    "The capital of France is Paris. The capital of Japan is Tokyo. Water boils at 100 C.",
    "user assistant system model: answer the question, explain your reasoning step by step.",
    "def add(a, b):\n    return a + b\n",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i * i)\n",
    "import torch\nx = torch.zeros(4, 8)\ny = x.sum(dim=-1)\n",
    'class Point:\n    """A point in the plane."""\n\n    def __init__(self, x, y):\n'
    "        self.x = x\n        self.y = y\n",
    "numbers = [1, 2, 3, 4, 5]\ntotal = sum(numbers) / len(numbers)\n",
]

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def _train_bpe(vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """A byte-level BPE trained on :data:`CORPUS`; the special tokens get the first ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special_tokens,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def tiny_llama_tokenizer() -> PreTrainedTokenizerFast:
    """ChatML tokenizer (SmolLM2 / Qwen style): no BOS, ``eos = <|im_end|>``."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok = _train_bpe(384, specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=512,
    )


def tiny_qwen2_tokenizer() -> PreTrainedTokenizerFast:
    """Gemma-style tokenizer: plain encoding prepends ``<bos>``, ``eos = <end_of_turn>``, the
    assistant role renders as ``model`` and a system message joins the first user turn."""
    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    tok = _train_bpe(448, specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A",
        pair="<bos> $A $B",
        special_tokens=[("<bos>", tok.token_to_id("<bos>"))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<end_of_turn>",
        pad_token="<pad>",
        chat_template=GEMMA_TEMPLATE,
        model_max_length=512,
    )


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _finish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.float().eval()


def _tiny(config_cls, model_cls, tokenizer, seed: int, tie: bool) -> tuple:
    """A seeded 2-layer model (hidden 32, 4 heads, 2 kv heads) of one family."""
    config = config_cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        **_special_ids(tokenizer),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return _finish(model, tokenizer), tokenizer


def tiny_llama(seed: int = 0) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A 2-layer Llama with untied embeddings and a ChatML tokenizer."""
    return _tiny(LlamaConfig, LlamaForCausalLM, tiny_llama_tokenizer(), seed, tie=False)


def tiny_qwen2(seed: int = 0) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """A 2-layer Qwen2 with tied embeddings and a Gemma-style tokenizer and template."""
    return _tiny(Qwen2Config, Qwen2ForCausalLM, tiny_qwen2_tokenizer(), seed, tie=True)


def save_tiny(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: str | os.PathLike
) -> str:
    """Save model and tokenizer side by side so ``from_pretrained(path)`` loads both."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
