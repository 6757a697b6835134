"""The trainer end to end: 2 CPU ranks, the tiny preset, the built-in learnable task.

Poisson sampling is on (the trainer's default).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from opacus.accountants import PRVAccountant

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _train(out, *flags, nproc=2):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(nproc), "-m", "opacus_fsdp_sync.train", "--out", str(out), *flags,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), rows, proc.stdout + proc.stderr


def _warned(output: str, text: str) -> list[str]:
    """The warning lines of ``output`` that contain ``text``."""
    return [line for line in output.splitlines() if "Warning: " in line and text in line]


def test_trains_and_reports_the_accountants_epsilon(tmp_path):
    summary, rows, stdout = _train(tmp_path, "--epochs", "2", "--physical-batch-size", "8")
    held = [r["heldout_loss"] for r in rows if "heldout_loss" in r]
    assert held[-1] < 0.85 * held[0], held  # learns the task despite the noise
    assert summary["steps"] == 30 and summary["examples_seen"] > 0
    hand = PRVAccountant()
    hand.history = [(summary["noise_multiplier"], 1 / 15, summary["steps"])]
    assert summary["epsilon"] == pytest.approx(hand.get_epsilon(summary["delta"]), rel=1e-9)
    assert f"[Ghost] done: epsilon {summary['epsilon']:.3f}" in stdout
    assert "[Ghost] sampling: shared Poisson draw" in stdout
    assert (tmp_path / "metrics.png").stat().st_size > 0
    assert summary["privacy_unit"] == "one example (one sequence) of the built-in synthetic task"
    assert {"train_loss", "heldout_loss", "examples_seen", "checkpoints"} <= set(
        summary["not_private"]
    )
    assert "[Ghost] privacy: Not private" in stdout


def test_fixed_batches_say_the_epsilon_does_not_hold(tmp_path):
    """``--no-poisson-sampling`` (about the warnings, not the sampling): the run still prints an
    epsilon, and warns beside it that it does not hold."""
    summary, _, output = _train(
        tmp_path, "--no-poisson-sampling", "--max-steps", "2", "--eval-every", "2", nproc=1
    )
    assert summary["privacy"]["poisson_sampling"] is False
    done = output.index("[Ghost] done: epsilon")
    assert "it does not hold for this run" in output[done:]  # beside the number
    assert "fixed batches (poisson_sampling=False)" in output


def test_same_seed_draws_other_batches_and_noise_unless_dp_seed(tmp_path):
    """``--seed`` decides the model and the split only; ``--dp-seed`` is the opt-in."""
    flags = ("--max-steps", "3", "--eval-every", "3", "--seed", "1")

    def run(name, *extra):
        _, rows, _ = _train(tmp_path / name, *flags, *extra)
        return [{k: v for k, v in r.items() if k != "step_ms"} for r in rows]

    a, b = run("a"), run("b")
    assert a[0] == b[0]  # the same model before training
    assert a[-1]["heldout_loss"] != b[-1]["heldout_loss"]
    assert [r["train_loss"] for r in a[1:]] != [r["train_loss"] for r in b[1:]]
    assert run("c", "--dp-seed", "7") == run("d", "--dp-seed", "7")


def test_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """A run that went past its step-4 checkpoint and died before the next one, resumed."""
    # --dp-seed: the two runs compared must draw the same batches and noise
    common = (
        "--max-steps", "8", "--checkpoint-every", "4", "--eval-every", "2", "--dp-seed", "5",
        "--lr-schedule", "cosine", "--warmup-steps", "2", "--weight-decay", "0.01",
    )  # fmt: skip
    straight, rows_a, _ = _train(tmp_path / "a", *common)
    _train(tmp_path / "b", *common)
    # steps 5-8 ran and were logged, then the run died before its step-8 checkpoint was written
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step000004")
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    resumed, rows_b, stdout = _train(tmp_path / "b", *common, "--resume")
    assert "resumed from" in stdout and "(4 metrics rows after it dropped)" in stdout
    # the draw ledger knows the run went 4 steps past the checkpoint: the log says what a
    # resume without fresh noise draws again
    assert "went 4 step(s) further" in stdout and "--fresh-noise" in stdout
    # with --fresh-noise those steps are counted, and steps 5-8 are taken again from the
    # checkpoint's schedule with new draws and noise: 12 steps counted for 8 taken
    fresh, rows_c, fresh_out = _train(tmp_path / "c", *common, "--resume", "--fresh-noise")
    assert "fresh_noise=True: every noise generator restarted" in fresh_out
    assert "are drawn again" not in fresh_out and "the accountant counts them" in fresh_out
    assert fresh["steps"] == 8 and fresh["privacy"]["steps"] == 12
    assert fresh["epsilon"] > straight["epsilon"]
    assert [r["step"] for r in rows_c] == list(range(9))  # each step once
    # a plain resume from that run's own checkpoint goes on from its step (8), not from the
    # accountant's count (12: it took the logical step from the count, trained nothing and
    # reported 12 steps of a plan of 8)
    shutil.copytree(tmp_path / "c", tmp_path / "d")
    again, _, again_out = _train(tmp_path / "d", *common, "--resume")
    assert "step000008 at step 8 " in again_out and again["steps"] == 8
    assert again["privacy"]["steps"] == 12 and again["epsilon"] == fresh["epsilon"]
    import torch

    def schedule(run):  # the learning-rate schedule saved with the run's step-8 checkpoint
        state = torch.load(tmp_path / run / "checkpoints" / "step000008" / "trainer_state.pt")
        return state["scheduler"]["last_epoch"], state["scheduler"]["_last_lr"]

    assert schedule("c") == schedule("a")  # steps 5-8 ran on the uninterrupted schedule
    assert [r["step"] for r in rows_b] == list(range(9))  # each step once
    later_a = [r for r in rows_a if r["step"] > 4]
    later_b = [r for r in rows_b if r["step"] > 4]
    # equal rows need the schedule resumed at step 4 (a fresh one would restart the warm-up)
    assert later_a and [{k: v for k, v in r.items() if k != "step_ms"} for r in later_a] == [
        {k: v for k, v in r.items() if k != "step_ms"} for r in later_b
    ]
    assert resumed["epsilon"] == straight["epsilon"] and resumed["steps"] == 8
    assert resumed["examples_seen"] == straight["examples_seen"]
    assert resumed["wall_s"] > straight["wall_s"] / 2  # the steps before the checkpoint count
    privacy = resumed["privacy"]
    assert (privacy["accountant"], privacy["steps"], privacy["max_grad_norm"]) == ("prv", 8, 1.0)
    assert privacy["sample_rate"] == pytest.approx(1 / 15) and privacy["secure_mode"] is False
    assert resumed["config"]["lr_schedule"] == "cosine"
    assert resumed["model"]["class"] == "LlamaForCausalLM"


def _probe_check(model, export_dir):
    import torch

    probe = torch.load(export_dir / "probe_logits.pt")
    with torch.no_grad():
        logits = model.eval()(input_ids=probe["input_ids"]).logits
    return logits, probe["logits"]


def test_export_loads_with_from_pretrained_and_init_from_continues(tmp_path):
    """2 FSDP2 ranks: the export's logits equal those the trained (sharded) model computed."""
    import torch
    from transformers import AutoModelForCausalLM

    summary, rows, stdout = _train(
        tmp_path / "a", "--max-steps", "4", "--eval-every", "2", "--save-every", "2"
    )
    export = tmp_path / "a" / "model"
    model = AutoModelForCausalLM.from_pretrained(export)
    logits, trained = _probe_check(model, export)
    torch.testing.assert_close(logits, trained, atol=1e-6, rtol=0)
    assert (tmp_path / "a" / "model-step000002" / "model.safetensors").is_file()
    privacy = json.loads((export / "privacy.json").read_text())
    assert privacy["epsilon"] == summary["epsilon"] and privacy["steps"] == 4
    assert privacy["accountant"] == "prv" and privacy["delta"] == summary["delta"]
    assert summary["privacy"] == privacy and "[Ghost] export:" in stdout
    # a new run from the export starts where this one ended (same split: --seed)
    _, rows_b, stdout = _train(
        tmp_path / "b", "--init-from", str(export), "--max-steps", "1", nproc=1
    )
    assert rows_b[0]["heldout_loss"] == pytest.approx(rows[-1]["heldout_loss"], rel=1e-5)
    # the weights carried 4 private steps: the new run counts them (its epsilon said 1 step's)
    later = json.loads((tmp_path / "b" / "model" / "privacy.json").read_text())
    assert later["steps"] == 5 and sum(n for _, _, n in later["history"]) == 5
    assert later["init_from"] == str(export) and "carries 4 private step(s)" in stdout
    hand = PRVAccountant()
    hand.history = [
        (privacy["noise_multiplier"], privacy["sample_rate"], 4),
        (later["noise_multiplier"], later["sample_rate"], 1),
    ]
    assert later["epsilon"] == pytest.approx(hand.get_epsilon(later["delta"]), rel=1e-9)
    assert later["epsilon"] > privacy["epsilon"]


def test_lora_trains_only_the_adapters_and_exports_adapter_and_merged(tmp_path):
    pytest.importorskip("peft")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from opacus_fsdp_sync.models import LlamaSpec, build_llama

    summary, rows, _ = _train(
        tmp_path / "a", "--lora", "--merge-lora", "--max-steps", "6", "--eval-every", "3"
    )
    assert summary["trainable"] and all("lora_" in n for n in summary["trainable"])
    assert summary["steps"] == 6
    export = tmp_path / "a" / "model"
    torch.manual_seed(0)  # the preset's base, as the trainer built it from --seed 0
    adapted = PeftModel.from_pretrained(build_llama(LlamaSpec(preset="tiny")), export / "adapter")
    logits, trained = _probe_check(adapted, export)
    torch.testing.assert_close(logits, trained, atol=1e-6, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(export / "merged")
    merged_logits, _ = _probe_check(merged, export)
    torch.testing.assert_close(merged_logits, logits, atol=1e-5, rtol=0)  # merging reorders sums
    _, rows_b, stdout_b = _train(
        tmp_path / "b", "--lora", "--init-from", str(export / "adapter"), "--max-steps", "1",
        nproc=1,
    )  # fmt: skip
    assert rows_b[0]["heldout_loss"] == pytest.approx(rows[-1]["heldout_loss"], rel=1e-5)
    # the adapter's record is one folder up: its 6 steps are counted by the new run
    later = json.loads((tmp_path / "b" / "model" / "privacy.json").read_text())
    assert later["steps"] == 7 and "carries 6 private step(s)" in stdout_b


def test_readme_quickstart_example_runs_with_poisson_sampling():
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.returncode == 0
    assert "epsilon" in proc.stdout
    assert "[Ghost] sampling: shared Poisson draw" in proc.stdout + proc.stderr
    # the three warnings each rank printed (opacus_fsdp_sync/known_warnings.py), once explained
    for text in ("returned a view tensor", "Full backward hook is firing", "Secure RNG"):
        assert not _warned(proc.stderr, text), text
    assert (proc.stdout + proc.stderr).count("[Ghost] warnings silenced as harmless here") == 1


def test_one_process_on_a_jsonl_file_with_a_target_epsilon(tmp_path):
    data = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": f"the number {i} follows {i - 1} and precedes {i + 1}."})
             for i in range(300)]  # fmt: skip
    data.write_text("\n".join(lines))
    summary, rows, stdout = _train(
        tmp_path / "out", "--data", str(data), "--target-epsilon", "4", "--epochs", "1",
        "--batch-size", "16", "--eval-every", "5", nproc=1,
    )  # fmt: skip
    assert summary["world_size"] == 1 and summary["steps"] > 0
    assert 3.95 <= summary["epsilon"] <= 4.0 + 1e-6  # the noise was chosen for the steps run
    # one process takes the same sampler as several (draws handed out once, counted as drawn)
    assert "[Ghost] sampling: shared Poisson draw" in stdout and "across 1 rank(s)" in stdout
    assert summary["privacy_unit"].startswith(f"one record of {data} (one example")
    assert summary["records"] == 300 and summary["records_truncated"] == 300
    assert "[Ghost] data: 300 records (text), one example and one privacy unit each" in stdout
    assert "heldout_loss" in summary["not_private"]


def test_local_hugging_face_model_and_tokenizer_with_chat_records(tmp_path):
    """A model directory as users keep one: weights and a tokenizer with a chat template,
    loaded without a hub; JSONL records of chat messages and of plain text."""
    from opacus_fsdp_sync.models import LlamaSpec, build_llama
    from tests.test_train_data import CHAT_TEMPLATE, _word_tokenizer

    path = _word_tokenizer(tmp_path / "model", CHAT_TEMPLATE)
    build_llama(LlamaSpec(preset="tiny")).save_pretrained(path)
    records = []
    for i in range(200):
        words = [f"w{(i + j) % 40}" for j in range(6)]
        chat = [{"role": "user", "content": " ".join(words[:3])},
                {"role": "assistant", "content": " ".join(words[3:])}]  # fmt: skip
        records.append({"messages": chat} if i % 2 else {"text": " ".join(words)})
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    summary, rows, stdout = _train(
        tmp_path / "out", "--model-path", str(path), "--data", str(data), "--max-steps", "4",
        "--eval-every", "2", nproc=1,
    )  # fmt: skip
    assert summary["steps"] == 4 and rows[0]["heldout_loss"] > 0
    assert summary["records"] == 200 and summary["record_kind"] == "messages+text"
    assert (tmp_path / "out" / "model" / "tokenizer.json").is_file()  # exported with the model


def test_committed_run_file_trains_and_exports(tmp_path):
    """``examples/train_tiny_instruct.toml`` as shipped, with ``--out`` overridden."""
    from pathlib import Path

    run = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_instruct.toml"
    summary, rows, stdout = _train(
        tmp_path, "--config", str(run), "--max-steps", "4", "--keep-last", "1", nproc=1
    )
    assert summary["steps"] == 4 and summary["record_kind"] == "prompt/completion"
    # the file checkpoints every 2 steps; --keep-last 1 leaves the newest only
    ckpts = tmp_path / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    # the draw ledger beside the checkpoints: how far the run went, for a fresh_noise resume
    assert len(names) == 3 and re.fullmatch(r"dp_draws_[0-9a-f]{16}\.json", names[0]), names
    assert names[1:] == ["latest", "step000004"]
    assert (ckpts / "latest").read_text() == "step000004"
    for step in (2, 4):
        assert f"[Ghost] checkpoint: saved step {step} to {ckpts}/step{step:06d} (kept 1)" in stdout
    assert summary["config"]["target_epsilon"] == 8.0 and summary["epsilon"] <= 8.0 + 1e-6
    # the progress bar's epsilon comes from the accountant the end reports (it once showed an
    # RDP 9.24 beside a PRV 7.996 against the target 8)
    shown = re.findall(r"eps=([0-9.]+)@(\d+)", stdout)
    assert shown and shown[-1] == (f"{summary['epsilon']:.2f}", "4"), (shown, summary["epsilon"])
    assert rows[-1]["epsilon"] == summary["epsilon"]
    assert rows[-1]["heldout_loss"] > 0
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert (tmp_path / "model" / "privacy.json").is_file()
    for text in ("Full backward hook is firing", "Secure RNG"):  # one process: no FSDP2 view
        assert not _warned(stdout, text), text
    assert stdout.count("[Ghost] warnings silenced as harmless here") == 1
