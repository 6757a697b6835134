"""DP instruction tuning with TRL's SFTTrainer: a plain TRL script, two lines changed.

Instruction-tunes the tiny Llama preset (random weights, no download) on the 40 prompt/completion
records shipped in ``examples/data/instruct_tiny.jsonl``, with the loss on the completions only
and the noise calibrated for a target epsilon. About a minute on a CPU; one process, or
``torchrun --standalone --nproc-per-node 2 examples/hf_sft.py`` (DDP). Needs ``pip install -e
".[trl]"``.

The two changes from a plain TRL script are marked ``# DP``: the import, and ``SFTTrainer(...)``
becoming ``DPSFTTrainer(..., dp_args=DPArguments(...))``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from datasets import Dataset
from trl import SFTConfig

from opacus_fsdp_sync.integrations.transformers import DPArguments, DPSFTTrainer  # DP
from opacus_fsdp_sync.known_warnings import quiet_known_warnings
from opacus_fsdp_sync.models.llama import LlamaSpec, build_llama
from opacus_fsdp_sync.models.tokenizer import char_tokenizer

DATA = Path(__file__).resolve().parent / "data" / "instruct_tiny.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    """The example's flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/hf_sft", help="output directory")
    parser.add_argument("--epochs", type=float, default=20.0, help="passes over the records")
    parser.add_argument("--max-steps", type=int, default=-1, help="cap on the steps (-1: none)")
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    parser.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="shard with accelerate's FSDP2 plugin (GPUs; on CPU accelerate runs DDP instead)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    """Trains, evaluates, saves the model; returns the last log line."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    quiet_known_warnings()  # three warnings harmless here (docs/train.md, "Warnings silenced")
    torch.manual_seed(0)  # the model's initialisation only: DP draws come from OS entropy
    model = build_llama(LlamaSpec(preset="tiny"))
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    split = Dataset.from_list(rows).train_test_split(test_size=0.1, seed=0)
    config = SFTConfig(
        output_dir=args.out,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_length=40,
        eval_strategy="steps",
        eval_steps=20,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        bf16=False,  # fp32 on CPU
        use_cpu=not torch.cuda.is_available(),  # torchrun on CPU: one rank per process
        disable_tqdm=True,
        # accelerate's FSDP2 plugin (the GPU campaign's hf_fsdp part checks this path)
        fsdp="full_shard" if args.fsdp else "",
        fsdp_config={"version": 2} if args.fsdp else None,
    )
    trainer = DPSFTTrainer(  # DP: was SFTTrainer
        model=model,
        args=config,
        train_dataset=split["train"],
        eval_dataset=split["test"],
        processing_class=char_tokenizer(),
        dp_args=DPArguments(  # DP: the only new argument
            target_epsilon=args.target_epsilon,
            delta=1e-5,
            max_grad_norm=1.0,
            logical_batch_size=8,
        ),
    )
    first = trainer.evaluate()["eval_loss"]
    trainer.train()
    last = trainer.evaluate()
    trainer.save_model()  # a from_pretrained model and privacy.json in --out
    summary = {
        "eval_loss_before": first,
        "eval_loss_after": last["eval_loss"],
        "epsilon": trainer.epsilon,
        "delta": trainer.dp_args.delta,
        "steps": trainer.state.global_step,
        "noise_multiplier": trainer.dp_session.noise_multiplier,
    }
    if trainer.is_world_process_zero():
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
