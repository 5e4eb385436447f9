"""A real Hugging Face tokenizer built on the fly (no download): a byte-level BPE trained
on a few sentences, with a BOS post-processor and a ChatML chat template, saved the way a
model directory holds it (`tokenizer.json`, `tokenizer_config.json`)."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template that loops over content parts (vLLM's "openai" content format) and uses the
# special tokens, tojson and raise_exception, as real templates do.
PARTS = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{% if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You are a helpful assistant. Answer briefly and precisely.",
    "What is the capital of France? The capital of France is Paris.",
    "Tell me a story about a cache that remembered every prompt it was given.",
    "KV cache blocks are reused when prompts share a prefix of whole blocks.",
    "Route each request to the instance that already holds its prefix.",
] * 20


def build_tokenizer(folder: Path, template: str = CHATML, vocab_size: int = 400) -> Path:
    """Train and save a tokenizer into `folder`; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        # as older configs write it: an AddedToken object
        "eos_token": {
            "__type": "AddedToken",
            "content": "</s>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
        "unk_token": "<unk>",
        "chat_template": template,
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder
