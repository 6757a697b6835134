"""The trainer's configuration and schedule, in process (no spawn)."""

import dataclasses

import pytest

from opacus_fsdp_sync.train.config import TrainConfig
from opacus_fsdp_sync.train.optim import lr_factor


def test_lr_schedule_warms_up_then_decays_to_zero_at_the_last_step():
    cosine = TrainConfig(lr_schedule="cosine", warmup_steps=2)
    assert [lr_factor(cosine, 10, s) for s in (0, 1, 2)] == [0.0, 0.5, 1.0]
    assert lr_factor(cosine, 10, 6) == pytest.approx(0.5) and lr_factor(cosine, 10, 10) == 0.0
    linear = TrainConfig(lr_schedule="linear")
    assert [lr_factor(linear, 4, s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_factor(TrainConfig(), 4, 3) == 1.0
    with pytest.raises(ValueError, match="lr_schedule='step'"):
        TrainConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="optimizer='adam'"):
        TrainConfig(optimizer="adam")


def _refused(capsys, monkeypatch, argv, rank="0"):
    from opacus_fsdp_sync.train.config import parse_args

    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == (1 if rank == "0" else 0), err  # one line, from rank 0 only
    return err


def test_help_shows_each_fields_docstring_default_and_choices(capsys):
    from opacus_fsdp_sync.train.config import field_docs, parse_args

    docs = field_docs()
    assert docs["warmup_steps"] == "Logical steps of linear warm-up from 0 to lr."
    assert set(docs) == {f.name for f in dataclasses.fields(TrainConfig)}
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Logical steps of linear warm-up from 0 to lr. (default: 0)" in text
    assert "--lr-schedule {constant,linear,cosine}" in text


def test_flag_errors_are_one_line_from_rank_zero(tmp_path, capsys, monkeypatch):
    err = _refused(capsys, monkeypatch, ["--model-path", str(tmp_path / "none")])
    assert "model_path=" in err and "no such directory" in err
    assert "invalid choice: 'sft'" in _refused(capsys, monkeypatch, ["--task", "sft"])
    assert "merge_lora=True needs lora=True" in _refused(capsys, monkeypatch, ["--merge-lora"])
    _refused(capsys, monkeypatch, ["--max-steps", "0"], rank="1")  # silent on other ranks


def test_out_holding_a_run_is_refused_unless_resume_or_overwrite(tmp_path, capsys, monkeypatch):
    from opacus_fsdp_sync.train.config import parse_args

    (tmp_path / "metrics.jsonl").write_text("")
    err = _refused(capsys, monkeypatch, ["--out", str(tmp_path)])
    assert "holds a run (metrics.jsonl)" in err and "--resume" in err and "--overwrite" in err
    assert parse_args(["--out", str(tmp_path), "--resume"]).resume
    assert parse_args(["--out", str(tmp_path), "--overwrite"]).overwrite
    assert parse_args(["--out", str(tmp_path / "new")]).out == str(tmp_path / "new")


def test_run_file_maps_onto_fields_and_flags_override_it(tmp_path, capsys, monkeypatch):
    from opacus_fsdp_sync.train.config import parse_args

    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    run = tmp_path / "run.toml"
    run.write_text('data = "d.jsonl"\nlr = 1\nlora = true\nmax_steps = 7\nout = "o"\n')
    cfg = parse_args(["--config", str(run), "--max-steps", "3", "--no-lora"])
    assert cfg.data == str(tmp_path / "d.jsonl")  # read against the run file's directory
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.out == "o"
    assert cfg.max_steps == 3 and cfg.lora is False  # the command line wins
    assert parse_args(["--config", str(run)]).lora is True
    run.write_text('max_step = 3\nlr = "fast"\n')
    err = _refused(capsys, monkeypatch, ["--config", str(run)])
    assert "unknown key(s) 'max_step'" in err and "known fields are model, model_path" in err
    run.write_text('lr = "fast"\n')
    assert "lr = 'fast' is a str; the field takes a float" in _refused(
        capsys, monkeypatch, ["--config", str(run)]
    )
    run.write_text("epochs = 0.0\n")
    assert "epochs > 0 required" in _refused(capsys, monkeypatch, ["--config", str(run)])
    assert "no such file" in _refused(capsys, monkeypatch, ["--config", str(tmp_path / "no")])
    run.write_text("lr = = 1\n")
    assert "run.toml" in _refused(capsys, monkeypatch, ["--config", str(run)])


def test_yaml_run_file_when_pyyaml_is_installed(tmp_path):
    pytest.importorskip("yaml")
    from opacus_fsdp_sync.train.config import parse_args

    run = tmp_path / "run.yaml"
    run.write_text("batch_size: 4\ndp_seed: null\ntarget_epsilon: 3\n")
    cfg = parse_args(["--config", str(run)])
    assert (cfg.batch_size, cfg.dp_seed, cfg.target_epsilon) == (4, None, 3.0)


def test_committed_tiny_instruct_run_file_is_complete():
    from pathlib import Path

    from opacus_fsdp_sync.train.config import parse_args
    from opacus_fsdp_sync.train.data import load_records

    root = Path(__file__).resolve().parents[1]
    cfg = parse_args(["--config", str(root / "examples" / "train_tiny_instruct.toml")])
    records = load_records(cfg.data)
    assert len(records) >= 40 and all({"prompt", "completion"} <= set(r) for r in records)
    assert cfg.model == "tiny" and cfg.max_steps is not None and cfg.max_steps <= 5


def test_docs_llama_run_file_names_only_fields(tmp_path):
    import re
    from pathlib import Path

    from opacus_fsdp_sync.train.run_file import load_run_file

    text = (Path(__file__).resolve().parents[1] / "docs" / "train.md").read_text()
    (block,) = re.findall(r"```toml\n(.*?)```", text, re.DOTALL)
    (tmp_path / "llama1b.toml").write_text(block)
    values = load_run_file(str(tmp_path / "llama1b.toml"), TrainConfig)
    assert values["model_path"] == "/path/to/Llama-3.2-1B" and values["lora"] is True
    assert values["target_epsilon"] == 8.0


def test_keep_last_prunes_older_checkpoints_and_keeps_latest_valid(tmp_path):
    from opacus_fsdp_sync.train.run_state import prune_checkpoints

    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8, 10):
        (ckpts / f"step{step:06d}").mkdir(parents=True)
        (ckpts / f"step{step:06d}" / "x").write_text("")
    (ckpts / "latest").write_text("step000008")  # step 10: left by a run that died
    assert [p.name for p in prune_checkpoints(ckpts, 0)] == [
        "step000002", "step000004", "step000006", "step000008",
    ]  # fmt: skip
    kept = prune_checkpoints(ckpts, 2)
    assert [p.name for p in kept] == ["step000006", "step000008"]
    left = sorted(p.name for p in ckpts.iterdir())
    assert left == ["latest", "step000006", "step000008", "step000010"]
    assert (ckpts / (ckpts / "latest").read_text()).is_dir()
    assert [p.name for p in prune_checkpoints(ckpts, 1)] == ["step000008"]
    with pytest.raises(ValueError, match="keep_last=-1"):
        TrainConfig(keep_last=-1)


def test_known_warnings_are_silenced_narrowly_and_explained(monkeypatch, caplog):
    import logging
    import warnings

    import opacus
    import torch
    from torch import nn

    from opacus_fsdp_sync import known_warnings

    monkeypatch.setattr(known_warnings, "_quieted", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with caplog.at_level(logging.INFO, logger="opacus_fsdp_sync"):
            known_warnings.quiet_known_warnings()
            known_warnings.quiet_known_warnings()  # once
        opacus.PrivacyEngine()  # the real "Secure RNG turned off"
        layer = nn.Linear(2, 2)
        layer.register_full_backward_hook(lambda *args: None)
        layer(torch.ones(1, 2)).sum().backward()  # the real "Full backward hook is firing"
        warnings.warn(
            "FSDP2-wrapped module (FSDPLlamaForCausalLM) returned a view tensor. An in-place op "
            "on this view (e.g., `x += y`) will silently drop the pre-backward hook",
            UserWarning,
            stacklevel=1,
        )  # torch's text (fsdp/_fully_shard/_fsdp_state.py); needs a process group to trigger
        warnings.warn("Secure RNG turned off", DeprecationWarning, stacklevel=1)  # other category
        warnings.warn("returned a view tensor", UserWarning, stacklevel=1)  # not the opening
    assert [str(w.message) for w in seen] == ["Secure RNG turned off", "returned a view tensor"]
    lines = [r.getMessage() for r in caplog.records if "silenced" in r.getMessage()]
    assert len(lines) == 1 and "Secure RNG turned off" in lines[0] and "OS entropy" in lines[0]


def test_tensorboard_writes_the_metrics_rows_as_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from opacus_fsdp_sync.train.tensorboard import MetricsWriter

    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write({"step": 0, "heldout_loss": 3.0, "epsilon": 0.0})
    writer.write({"step": 1, "train_loss": 2.5, "step_ms": 9.0})
    writer.write({"step": 2, "train_loss": 2.0, "heldout_loss": 2.2, "epsilon": 0.7})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
               for tag in events.Tags()["scalars"]}  # fmt: skip
    assert scalars["train/loss"] == [(1, 2.5), (2, 2.0)]
    assert [s for s, _ in scalars["heldout/loss"]] == [0, 2]
    assert scalars["privacy/epsilon"][-1][1] == pytest.approx(0.7)
    MetricsWriter(tmp_path / "off", enabled=False).write({"step": 1, "train_loss": 1.0})
    assert not (tmp_path / "off").exists()


def test_tensorboard_without_the_package_is_a_one_line_flag_error(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    err = _refused(capsys, monkeypatch, ["--tensorboard"])
    assert "tensorboard=True needs the tensorboard package" in err and "[tensorboard]" in err
