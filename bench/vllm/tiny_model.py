"""A tiny Llama for real engines, built here without any hub: a byte-level BPE tokenizer
trained on this interpreter's standard library sources and random weights from a seed.

Run by the engines' python (it needs torch, transformers and tokenizers):
`.venv-vllm/bin/python -m bench.vllm.tiny_model --out DIR --seed 0`. The same seed and the
same Python give the same files. Its output is random tokens: send `ignore_eos` for exact
output lengths.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
TRAINING_BYTES = 8_000_000
# Each message on its own line after its role; the prompt ends where the answer starts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part.get('text', '') }}{% endfor %}"
    "{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MODEL_SHAPE = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 4096,
}  # fmt: skip


def training_text() -> Iterator[str]:
    """The standard library's sources in name order, up to `TRAINING_BYTES`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text
        if total >= TRAINING_BYTES:
            return


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )  # fmt: skip
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(str(out))


def build_model(out: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        torch_dtype="bfloat16", tie_word_embeddings=False, **MODEL_SHAPE,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3})
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm.tiny_model", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (default: 0)")
    args = parser.parse_args(argv)
    partial = args.out.with_name(args.out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    build_tokenizer(partial)
    build_model(partial, args.seed)
    partial.replace(args.out)  # a folder that exists is a whole model
    print(f"tiny model written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
