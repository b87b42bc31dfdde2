"""Fine-tune a tiny Qwen3 with transformers' Trainer and patchdsl's fused kernels.

    python examples/train_sft.py examples/train_sft.yaml                 # the YAML beside this file
    python examples/train_sft.py examples/train_sft.yaml --max_steps 4   # command-line overrides
    python examples/train_sft.py --kpatch_spec qwen3 --max_steps 4       # no YAML at all

The Trainer writes into --output_dir, by default a folder in the system's temporary folder
(``$TMPDIR/patchdsl-train_sft``), not into the current folder.

Everything runs offline on a CPU in a couple of minutes (the kernels run in Triton's interpreter
there; on a GPU they are compiled): the model is Qwen3's architecture from the config shipped with
patchdsl, shrunk to 2 layers and a 256-token (byte) vocabulary, with random weights; the data is
synthetic text, tokenised as bytes.  The patchdsl part is the four marked lines.
"""

import math
import os
import random
import sys
import tempfile
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments

import patchdsl                                                         # patchdsl (1/4)
from patchdsl.model import config_from_dict, shipped_config_path, tiny_config


@dataclass
class ScriptArguments:
    model_config: str = field(default="Qwen/Qwen3-0.6B", metadata={"help": "Shipped architecture config to shrink."})
    layers: int = field(default=2, metadata={"help": "Decoder layers of the tiny model."})
    seq_len: int = field(default=16, metadata={"help": "Tokens (bytes) per training sequence."})
    num_texts: int = field(default=200, metadata={"help": "Synthetic sentences to generate."})
    eval_blocks: int = field(default=4, metadata={"help": "Blocks held out for evaluation."})


SUBJECTS = ["the river", "a small robot", "the old baker", "every student", "the night train", "my neighbour's cat"]
VERBS = ["carries", "paints", "remembers", "counts", "follows", "repairs"]
OBJECTS = ["three red apples", "the morning light", "a broken clock", "seven quiet songs", "the last letter"]
PLACES = ["by the harbour", "under the bridge", "in the garden", "at the station", "on the hill"]


def synthetic_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}." for _ in range(n)]


def byte_blocks(texts: list[str], seq_len: int) -> list[dict]:
    """Byte-level tokens (vocabulary 256), packed into blocks; labels are the inputs (the model shifts them)."""
    ids = torch.tensor(list(" ".join(texts).encode("utf-8")), dtype=torch.long)
    n = len(ids) // seq_len
    return [{"input_ids": b, "labels": b.clone()} for b in ids[: n * seq_len].view(n, seq_len)]


def tiny_qwen3(name: str, layers: int):
    import json

    path = shipped_config_path(name)
    if path is None:
        sys.exit(f"no shipped config for {name}")
    cfg = tiny_config(config_from_dict(json.loads(path.read_text())), layers=layers, vocab=256)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


# where the Trainer writes (checkpoints, logs) unless --output_dir or the YAML says otherwise: a folder in
# the system's temporary folder, never the checkout or the current folder (transformers' own default is
# ./trainer_output)
DEFAULT_OUTPUT_DIR = os.path.join(tempfile.gettempdir(), "patchdsl-train_sft")


def parse(argv=None):
    parser = HfArgumentParser((TrainingArguments, patchdsl.PatchdslArguments, ScriptArguments))  # patchdsl (2/4)
    parser.set_defaults(output_dir=DEFAULT_OUTPUT_DIR)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].endswith((".yaml", ".yml")):
        import yaml

        with open(argv[0]) as f:
            parser.set_defaults(**yaml.safe_load(f))      # the YAML's values, overridden by the command line
        argv = argv[1:]
    return parser.parse_args_into_dataclasses(argv)       # patchdsl (3/4): kpatch_args


def main() -> None:
    training_args, kpatch_args, script = parse()
    torch.manual_seed(training_args.seed)
    blocks = byte_blocks(synthetic_texts(script.num_texts, training_args.seed), script.seq_len)
    n_eval = script.eval_blocks
    train, evaluation = blocks[n_eval:], blocks[:n_eval]
    model = tiny_qwen3(script.model_config, script.layers)
    print(f"outputs (checkpoints, logs): {training_args.output_dir}")
    print(f"model: tiny {model.config.model_type}, {model.config.num_hidden_layers} layers, hidden "
          f"{model.config.hidden_size}, vocab {model.config.vocab_size}; data: {len(train)} train / {n_eval} eval "
          f"blocks of {script.seq_len} bytes")
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                      callbacks=[patchdsl.PatchdslCallback.from_args(kpatch_args)])  # patchdsl (4/4)
    result = trainer.train()
    for entry in trainer.state.log_history:
        if "patchdsl" in entry:
            print(f"patchdsl: {entry['patchdsl']}")
    metrics = trainer.evaluate()
    print(f"train loss {result.training_loss:.4f}; eval loss {metrics['eval_loss']:.4f} "
          f"(perplexity {math.exp(metrics['eval_loss']):.2f}) after {result.global_step} steps")


if __name__ == "__main__":
    main()
