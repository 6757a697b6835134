"""The trainer's configuration: one typed dataclass, one CLI flag per field."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..models.llama import PRESETS, TASKS
from .disclosure import PRIVACY_NOTE
from .run_file import load_run_file

#: The allowed values of the fields that take one of a few (checked, and shown by ``--help``).
CHOICES: dict[str, tuple[str, ...]] = {
    "task": tuple(TASKS),
    "fsdp_api": ("fsdp2", "fsdp1", "ddp"),
    "mixed_precision": ("auto", "bf16", "fp32"),
    "optimizer": ("adamw", "sgd"),
    "lr_schedule": ("constant", "linear", "cosine"),
}


@dataclass(kw_only=True)
class TrainConfig:
    """A DP fine-tuning run.

    Every field is a CLI flag (``--max-grad-norm`` for ``max_grad_norm``).
    """

    model: str = "tiny"
    """Preset (random initialisation): ``tiny``, ``small`` or ``llama3.2-1b``."""
    model_path: str | None = None
    """A local Hugging Face checkpoint directory (model and tokenizer) instead of a preset."""
    task: str = "causal_lm"
    """``causal_lm`` or ``seq_cls`` (a sequence classifier)."""
    data: str | None = None
    """A local ``.txt`` (one example per line) or ``.jsonl`` file (``text``, and ``label`` for
    ``seq_cls``); None: a built-in learnable synthetic task."""
    heldout_fraction: float = 0.1
    """Share of the examples kept out of training to measure the held-out loss."""
    num_examples: int = 512
    """Examples of the synthetic task."""
    seq_length: int = 16
    """Tokens per example."""
    init_from: str | None = None
    """Start from an export of an earlier run: a full model directory (instead of
    ``model_path``/``model``), or a LoRA ``adapter/`` directory loaded on top of them (trained
    on with ``lora``, else merged into the base)."""
    lora: bool = False
    """Train peft LoRA adapters (extra ``[lora]``) instead of every weight."""
    merge_lora: bool = False
    """With ``lora``: also export the adapters merged into the base (``merged/``)."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator."""
    fsdp_api: str = "fsdp2"
    """``fsdp2``, ``fsdp1`` or ``ddp`` (several ranks; one process trains the plain model)."""
    strategy: str = "full"
    """``ShardingConfig.strategy``."""
    mixed_precision: str = "auto"
    """``auto`` (bf16 params / fp32 reduce on GPU, fp32 on CPU), ``bf16`` or ``fp32``."""
    target_epsilon: float | None = None
    """Pick the noise for this epsilon at ``delta`` over the steps the run takes (``epochs``,
    or ``max_steps`` if fewer); else ``noise_multiplier``."""
    noise_multiplier: float = 0.5
    """Noise multiplier when no target epsilon is given."""
    delta: float = 1e-5
    """DP delta."""
    max_grad_norm: float = 1.0
    """Clipping bound (flat, whole-model)."""
    batch_size: int = 32
    """Expected logical batch over all ranks (Poisson sampling draws around it)."""
    physical_batch_size: int | None = None
    """Largest batch per rank per forward (``BatchMemoryManager``); None: the whole share."""
    poisson_sampling: bool = True
    """Poisson sampling (what the accountant assumes); off only for debugging."""
    epochs: float = 3.0
    """Passes over the training set (``epochs x steps per epoch`` logical steps, rounded down)."""
    max_steps: int | None = None
    """Stop after this many logical steps (None: ``epochs``); a target epsilon is met here."""
    optimizer: str = "adamw"
    """``adamw`` or ``sgd``."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for AdamW)."""
    lr_schedule: str = "constant"
    """``constant``, ``linear`` or ``cosine`` (decay to 0 at the last step), after the warm-up;
    stepped once per logical step and resumed with the checkpoint."""
    warmup_steps: int = 0
    """Logical steps of linear warm-up from 0 to ``lr``."""
    seed: int = 0
    """Model initialisation and the data split only: never the Poisson draws or the noise."""
    dp_seed: int | None = None
    """Reproducible Poisson draws and noise (``PrivacyEngine(dp_seed=...)``) for tests and
    debugging; privacy then rests on it staying secret. None: OS entropy."""
    eval_every: int = 10
    """Held-out loss every N logical steps (and at the end)."""
    checkpoint_every: int = 0
    """DCP checkpoint (with the DP state) every N logical steps; 0: none."""
    keep_last: int = 0
    """Keep only the N newest checkpoints (older ones deleted after each successful save; the
    ``latest`` marker always names a kept one); 0: keep all."""
    save_every: int = 0
    """Also export the model every N logical steps (``out/model-stepNNNNNN``); the final
    export (``out/model``) is always written. 0: only the final one."""
    resume: bool = False
    """Continue from the latest checkpoint in ``out``."""
    fresh_noise: bool = False
    """With ``resume``: restart every noise generator from OS entropy, count every step the
    earlier run took after the checkpoint (the draw ledger) and draw new batches, for a run
    whose outputs after the checkpoint (``save_every`` exports, metrics) may have been seen."""
    tensorboard: bool = False
    """Also write the train and held-out loss and epsilon to ``out/tensorboard`` (extra
    ``[tensorboard]``)."""
    timing: bool = False
    """``[Ghost]`` per-phase timings."""
    out: str = "runs/train"
    """Directory for ``metrics.jsonl``, ``metrics.png``, ``summary.json``, checkpoints and the
    exported model; one that holds a run is refused unless ``resume`` or ``overwrite``."""
    overwrite: bool = False
    """Train into an ``out`` that holds an earlier run (its files are replaced)."""

    def __post_init__(self) -> None:
        if self.fresh_noise and not self.resume:
            raise ValueError("fresh_noise=True restarts the noise of a resume: pass --resume too")
        if self.model_path is None and self.model not in PRESETS:
            raise ValueError(f"model={self.model!r}: choose one of {sorted(PRESETS)}")
        for name, choice in (
            ("task", self.task),
            ("fsdp_api", self.fsdp_api),
            ("mixed_precision", self.mixed_precision),
            ("optimizer", self.optimizer),
            ("lr_schedule", self.lr_schedule),
        ):
            if choice not in CHOICES[name]:
                raise ValueError(f"{name}={choice!r}: choose one of {CHOICES[name]}")
        for name, path in (("model_path", self.model_path), ("init_from", self.init_from)):
            if path is not None and not Path(path).is_dir():
                raise ValueError(
                    f"{name}={path!r}: no such directory (a local Hugging Face "
                    "model directory; nothing is downloaded)"
                )
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={self.heldout_fraction}: must be in (0, 1)")
        for name, count in (
            ("batch_size", self.batch_size),
            ("seq_length", self.seq_length),
            ("num_examples", self.num_examples),
            ("eval_every", self.eval_every),
            ("lora_r", self.lora_r),
        ):
            if count < 1:
                raise ValueError(f"{name}={count}: must be at least 1")
        for name, every in (
            ("save_every", self.save_every),
            ("checkpoint_every", self.checkpoint_every),
            ("keep_last", self.keep_last),
        ):
            if every < 0:
                raise ValueError(f"{name}={every}: must be 0 (off) or positive")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.lr <= 0:
            raise ValueError("warmup_steps >= 0, weight_decay >= 0 and lr > 0 required")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                "tensorboard=True needs the tensorboard package: pip install -e '.[tensorboard]'"
            )
        if self.merge_lora and not self.lora:
            raise ValueError("merge_lora=True needs lora=True")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps}: at least 1 (or None)")
        if self.physical_batch_size is not None and self.physical_batch_size < 1:
            raise ValueError(f"physical_batch_size={self.physical_batch_size}: at least 1")
        if self.target_epsilon is not None and self.target_epsilon <= 0:
            raise ValueError(f"target_epsilon={self.target_epsilon}: must be positive")
        if self.noise_multiplier < 0 or self.max_grad_norm <= 0 or self.epochs <= 0:
            raise ValueError("noise_multiplier >= 0, max_grad_norm > 0 and epochs > 0 required")


#: Files whose presence in ``out`` means it holds a run.
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints")


def check_out(cfg: TrainConfig) -> None:
    """Refuses an ``out`` that holds a run, unless ``resume`` or ``overwrite``.

    Raises:
        ValueError: naming the directory and the two flags.
    """
    held = [name for name in RUN_FILES if (Path(cfg.out) / name).exists()]
    if held and not (cfg.resume or cfg.overwrite):
        raise ValueError(
            f"out={cfg.out!r} holds a run ({', '.join(held)}): pass --resume to continue it or "
            "--overwrite to replace it"
        )


def field_docs() -> dict[str, str]:
    """Each :class:`TrainConfig` field's docstring (the string under it in the source)."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr):
            if isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split()).replace("``", "")
    return docs


class _Parser(argparse.ArgumentParser):
    """Flag errors as one line from rank 0 (every rank exits with status 2)."""

    def error(self, message: str):  # noqa: D102
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Maps CLI flags one-to-one onto :class:`TrainConfig` fields.

    ``--config FILE`` first takes the fields a run file sets (:mod:`.run_file`); the flags given
    on the command line override them. A value that :class:`TrainConfig` refuses, or a run file
    it cannot read, ends the process like a bad flag does: one line (from rank 0), exit status 2.
    """
    parser = _Parser(
        prog="opacus-fsdp-sync-train",
        description="DP fine-tuning under FSDP2, FSDP1 or DDP.",
        epilog=PRIVACY_NOTE,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="A run file (.toml; .yaml with PyYAML) of TrainConfig fields; flags override it.",
    )
    docs = field_docs()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        doc = docs.get(f.name, "")
        if kind.startswith("bool"):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=doc
            )
            continue
        base = {"int": int, "float": float}.get(kind.split(" ")[0], str)
        parser.add_argument(
            flag, type=base, default=f.default, choices=CHOICES.get(f.name), help=doc
        )
    try:
        run_file = parser.parse_known_args(argv)[0].config
        if run_file is not None:
            parser.set_defaults(**load_run_file(run_file, TrainConfig))
        values = vars(parser.parse_args(argv))
        values.pop("config")
        cfg = TrainConfig(**values)
        check_out(cfg)
        return cfg
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: error() exits
