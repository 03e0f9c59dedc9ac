"""The first minutes with `lightning-dp`: help that fits a screen, short errors with "did you mean", --print_config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lightning.pytorch import LightningDataModule

from lightning_dp import cli
from lightning_dp.commands.errors import condense, root_message, suggest

REPO_ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(REPO_ROOT / "examples" / "dpsgd_digits.yaml")


def test_help_lists_every_subcommand_on_one_line(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, line in cli.COMMANDS.items():
        assert f"  {name}" in out and line in out
        assert len([row for row in out.splitlines() if row.strip().startswith(name + " ")]) == 1
    assert set(cli.COMMANDS) == {"fit", "validate", "test", *cli.EXTRA_COMMANDS}
    assert max(map(len, out.splitlines())) <= 110  # no wrapped or truncated line on a normal terminal
    assert cli.main([]) == 2 and "commands:" in capsys.readouterr().err


def test_fit_help_is_focused_and_names_the_configs_classes(capsys):
    assert cli.main(["fit", "--config", DIGITS, "--help"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 40  # LightningCLI's is 536 lines: behind --help-all
    assert "--help-all" in out and "--print_config" in out
    assert "lightning-dp fit --model.help lightning_dp.models.ImageClassifier" in out
    assert "lightning-dp fit --trainer.callbacks.help lightning_dp.callbacks.DPSGD" in out
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--help-all"])
    assert info.value.code == 0 and "--trainer.gradient_clip_val" in capsys.readouterr().out


def _short(capsys, args: list[str]) -> str:
    try:
        code = cli.main(args)
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    return err


def test_a_refused_value_prints_the_classes_message_in_a_few_lines(capsys, workdir):
    err = _short(capsys, ["fit", "--config", DIGITS, "--model.init_args.lr=-1"])
    assert "lightning-dp fit: error: lr=-1.0 must be a finite number > 0; pass e.g. lr=0.1." in err
    err = _short(capsys, ["fit", "--config", DIGITS, "--trainer.callbacks.init_args.max_grad_norm=-1"])
    assert "max_grad_norm=-1.0 is not allowed" in err


def test_did_you_mean_for_options_init_args_class_paths_and_subcommands(capsys, workdir):
    err = _short(capsys, ["fit", "--config", DIGITS, "--trainer.max_epoks=1"])
    assert "unrecognized arguments: --trainer.max_epoks=1" in err and "did you mean --trainer.max_epochs" in err
    err = _short(capsys, ["fit", "--config", DIGITS, "--model.init_args.lrr=1"])
    assert "Option 'lrr' is not accepted" in err and "did you mean --model.init_args.lr?" in err
    err = _short(capsys, ["fit", "--config", DIGITS, "--model=lightning_dp.models.ImageClassifer"])
    assert "did you mean lightning_dp.models.ImageClassifier" in err
    err = _short(capsys, ["fitt", "--config", DIGITS])
    assert "unknown command 'fitt'" in err and "did you mean fit?" in err


def test_full_traceback_on_request(capsys, workdir, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DP_TRACEBACK", "1")
    with pytest.raises(Exception, match="lr=-1.0 must be a finite number"):
        cli.main(["fit", "--config", DIGITS, "--model.init_args.lr=-1"])


def test_condense_keeps_what_the_user_acts_on():
    nested = ('Parser key "model":\n  - Expected a path but a.B either not accessible or invalid\n'
              "  - Does not validate against any of the Union subtypes\n  Subtypes: [<class 'X'>, <class 'NoneType'>]\n"
              "  Errors:\n    - Problem with given class_path 'a.B':\n        module 'a' has no attribute 'B'\n"
              "    - Expected a <class 'NoneType'>\n  Given value type: <class 'str'>\n  Given value: a.B")
    assert condense(nested) == "model: class_path 'a.B': module 'a' has no attribute 'B'"
    assert condense("plain message") == "plain message"
    try:
        try:
            raise ValueError("lr=-1 must be > 0")
        except ValueError as inner:
            raise RuntimeError("Errors:\n - wrapped\n Given value: x") from inner
    except RuntimeError as outer:
        assert root_message(outer) == "lr=-1 must be > 0"
    assert suggest("unrecognized arguments: --trainer.max_epoks=1", ["--trainer.max_epochs", "--seed"]) == \
        "did you mean --trainer.max_epochs?"
    assert suggest("something else entirely") == ""


def test_print_config_works_for_every_subcommand(capsys, workdir):
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", DIGITS, "--print_config"])
    assert info.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["lr"] == 0.2
    assert cli.main(["grid", "--config", DIGITS, "--set", "model.init_args.lr=0.1,0.3", "--print_config"]) == 0
    out = capsys.readouterr().out
    assert out.count("# grid point") == 2 and "lr: 0.1" in out and "lr: 0.3" in out
    assert not list(workdir.rglob("*.ckpt"))  # nothing was trained
    with pytest.raises(SystemExit) as info:
        cli.main(["audit", "--config", str(REPO_ROOT / "examples" / "dlg_digits.yaml"), "--print_config"])
    assert info.value.code == 0 and "class_path: lightning_dp.models.SigmoidLeNet" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(["audit", "mia", "--config", str(REPO_ROOT / "examples" / "audit" / "mia_lm.yaml"), "--print_config"])
    assert info.value.code == 0 and "CausalLanguageModel" in capsys.readouterr().out
    assert cli.main(["epsilon", "--dataset-size", "100", "--batch-size", "10", "--epochs", "2",
                     "--noise-multiplier", "1", "--print_config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["noise_multiplier"] == 1.0


def test_a_missing_dataset_is_one_message_and_leaves_nothing_behind(capsys, workdir):
    data_dir = workdir / "no_mnist"
    code = cli.main(["fit", "--config", str(REPO_ROOT / "examples" / "dpsgd_mnist.yaml"),
                     f"--data.init_args.data_dir={data_dir}", "--data.init_args.download=false"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) <= 7, err
    assert f"MNIST is not in data_dir={data_dir}" in err and "t10k-labels-idx1-ubyte.gz" in err
    assert not data_dir.exists()


def test_audit_help_lists_known_subclasses_briefly(capsys):
    """jsonargparse lists every torch.nn.Module subclass (about 530) under --model: cut to a few."""
    for args in (["audit", "--help"], ["audit", "mia", "--help"]):
        with pytest.raises(SystemExit) as info:
            cli.main(args)
        out = capsys.readouterr().out
        assert info.value.code == 0 and len(out.splitlines()) < 150, len(out.splitlines())
        assert "more)" in out and "--print_config" in out


class BuggyData(LightningDataModule):
    """A DataModule whose constructor has a bug (not a refused value)."""

    def __init__(self, batch_size: int = 1, seed: int = 0) -> None:
        super().__init__()
        self.missing = None
        self.missing.size  # AttributeError: a bug, which must keep its traceback


def test_a_bug_in_a_constructor_keeps_its_traceback(capsys, workdir):
    from lightning_dp.commands.errors import ConfigurationError, root_cause

    with pytest.raises(Exception) as info:  # jsonargparse's ValueError, caused by the bug: the traceback shows both
        cli.main(["fit", "--config", DIGITS, f"--data={__name__}.BuggyData", "--data.batch_size=64"])
    assert not isinstance(info.value, ConfigurationError)
    assert isinstance(root_cause(info.value), AttributeError)


def test_grid_refusals_are_short_too(capsys, workdir):
    err = _short(capsys, ["grid", "--config", DIGITS, "--set", "model.init_args.lr=-1,0.1"])
    assert "lightning-dp grid: error: lr=-1.0 must be a finite number > 0" in err
    assert cli.main(["grid", "--config", DIGITS, "--set", "trainer.max_epochz=1,2", "--print_config"]) == 2
    assert "did you mean --trainer.max_epochs" in capsys.readouterr().err


_LIGHT = [["--version"], ["--help"], ["fit", "--help"], ["fit", "--config", DIGITS, "--help"], ["epsilon", "--help"],
          ["grid", "--help"], ["fitt"], ["fit", "--config", "examples/dpsgd_digit.yaml"], ["epsilon", "--sigma", "1"],
          ["epsilon", "--sample-rate", "0.1", "--steps", "10", "--target-epsilon", "-3"], ["grid"],
          ["grid", "--config", DIGITS, "--sett", "x=1"]]


def test_help_version_and_argument_errors_import_no_torch_lightning_or_mlflow():
    """The answers users wait for before anything runs: no heavy import (timed by benchmarks/bench_cli.py)."""
    import subprocess
    import sys

    script = ("import sys\nfrom lightning_dp.cli import main\n"
              f"for args in {_LIGHT!r}:\n"
              "    try:\n        main(args)\n    except SystemExit:\n        pass\n"
              "heavy = sorted(m for m in ('torch', 'lightning', 'mlflow', 'jsonargparse') if m in sys.modules)\n"
              "print('HEAVY', heavy)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert "HEAVY []" in done.stdout, done.stdout + done.stderr


def test_a_class_help_does_not_import_mlflow():
    """`--trainer.callbacks.help DPSGD` needs Lightning, not MLflow (issue 50, item 9: 1.3-1.5 s of each class help,
    docs/benchmarks.md; matplotlib comes with torchmetrics)."""
    import subprocess
    import sys

    script = ("import sys\nfrom lightning_dp.cli import main\n"
              "try:\n    main(['fit', '--trainer.callbacks.help', 'DPSGD'])\nexcept SystemExit:\n    pass\n"
              "print('HEAVY', sorted(m for m in ('mlflow',) if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert "--trainer.callbacks.init_args.noise_multiplier" in done.stdout and "HEAVY []" in done.stdout, done.stderr


def test_every_command_refuses_in_three_lines_with_did_you_mean(capsys, workdir):
    err = _short(capsys, ["epsilon", "--sigma", "1.1"])
    assert "unrecognized arguments: --sigma 1.1" in err and "did you mean --noise-multiplier?" in err
    err = _short(capsys, ["epsilon", "--dataset-size", "100", "--batch-size", "10", "--epochs", "2",
                          "--target-epsilon", "-3"])
    assert "lightning-dp epsilon: error: --target-epsilon=-3.0: must be > 0" in err
    err = _short(capsys, ["epsilon", "--sample-rate", "0.1", "--accountant", "pdl", "--steps", "3"])
    assert "did you mean pld?" in err
    err = _short(capsys, ["grid", "--config", DIGITS, "--sett", "x=1"])
    assert "did you mean --set or --select?" in err
    err = _short(capsys, ["fit", "--config", "examples/dpsgd_digit.yaml"])
    assert "no such file" in err
    err = _short(capsys, ["fit", "--config", DIGITS,
                          "--model.init_args.network.class_path=lightning_dp.models.DigitConvNet"])
    assert "did you mean lightning_dp.models.DigitsConvNet?" in err  # the innermost class path, from its module
    assert err.count("class_path") == 1
    err = _short(capsys, ["audit", "--bogus", "1"])
    assert "lightning-dp audit: error: unrecognized arguments: --bogus 1" in err
    err = _short(capsys, ["audit", "mia", "--bogus"])
    assert "lightning-dp audit mia: error: unrecognized arguments: --bogus" in err


def test_a_trainer_longer_than_the_plan_is_refused_before_data_summary_or_run(capsys, workdir):
    import sqlite3

    err = _short(capsys, ["fit", "--config", DIGITS, "--trainer.max_epochs=40"])
    assert "DPSGD plans 30 epochs (epochs=30) but the Trainer runs up to 40 epochs" in err
    assert "--trainer.max_epochs=30" in err and "--trainer.callbacks.init_args.epochs=40" in err
    out = capsys.readouterr().out
    assert "Trainable params" not in out  # no model summary before the refusal
    db = Path("mlruns") / "mlflow.db"
    assert not db.exists() or sqlite3.connect(db).execute("select count(*) from runs").fetchone() == (0,)


def test_the_baseline_prints_its_summary_after_the_bar(capsys, workdir):
    base = str(REPO_ROOT / "examples" / "digits_nonprivate.yaml")
    assert cli.main(["fit", "--config", base, "--trainer.max_epochs=1", "--trainer.limit_train_batches=3",
                     "--trainer.limit_val_batches=2"]) is None
    out = capsys.readouterr().out
    assert "Non-private training: 3 steps (1 epoch)" in out and "privacy   none" in out and "val/acc" in out
    assert out.index("Non-private training") < out.index("MLflow run ")
    if "Epoch 0/0" in out:  # the progress bar's last frame (Rich, in a log) comes before the summary
        assert out.rindex("Epoch 0/0") < out.index("Non-private training"), out


def test_class_help_spells_options_as_the_hints_do_and_shows_no_markup(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", DIGITS, "--trainer.callbacks.help", "lightning_dp.callbacks.DPSGD"])
    out = capsys.readouterr().out
    assert "--trainer.callbacks.init_args.epochs EPOCHS" in out and "--trainer.callbacks.epochs" not in out
    assert "``" not in out and ":class:" not in out
    with pytest.raises(SystemExit):
        cli.main(["epsilon", "--help"])
    assert "``" not in capsys.readouterr().out


def test_a_missing_base_checkpoint_is_a_short_error_with_its_absolute_path_and_maker(capsys, workdir):
    """examples/lm/dp_lora_wikitext2.yaml before its stage 1 (issue 50, item 3): three lines, status 2, the path
    the run looked at (absolute), the command that writes it and the fix; not a 107-line traceback."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    err = _short(capsys, ["fit", "--config", str(REPO_ROOT / "examples" / "lm" / "dp_lora_wikitext2.yaml"),
                          "--trainer.logger=false"])
    absolute = workdir.resolve() / "checkpoints" / "gpt2-wikitext2-public" / "base.ckpt"
    assert f"no such file {absolute}" in err, err
    assert "lightning-dp fit --config examples/lm/gpt2_public_pretrain.yaml" in err
    assert "run it first, or set checkpoint to the file's path" in err


def test_a_typo_in_a_yaml_key_names_the_file_and_line_and_the_key_as_yaml_spells_it(capsys, workdir):
    """Issue 50, item 5: the --config file's typo gets "did you mean" as the command line's does, with the file and
    the line, in the file's words (not a CLI flag) and without jsonargparse's list of what a subclass may be."""
    text = Path(DIGITS).read_text()
    trainer = workdir / "trainer_typo.yaml"
    trainer.write_text(text.replace("  max_epochs: 30", "  max_epoch: 30"))
    line = text.splitlines().index("  max_epochs: 30") + 1
    err = _short(capsys, ["fit", "--config", str(trainer)])
    assert f"error: {trainer}, line {line}: " in err and "'trainer.max_epoch'" in err, err
    assert "did you mean max_epochs" in err and "(under trainer:)" in err
    callback = workdir / "callback_typo.yaml"
    callback.write_text(text.replace("max_grad_norm: 0.5", "max_grad_nrom: 0.5"))
    line = text.splitlines().index("        max_grad_norm: 0.5") + 1
    err = _short(capsys, ["fit", "--config", str(callback)])
    assert f"error: {callback}, line {line}: " in err and "Option 'max_grad_nrom' is not accepted" in err, err
    assert "did you mean max_grad_norm (init_args of DPSGD)?" in err
    assert "Subclass types expect" not in err and "Not a valid subclass" not in err and "--trainer." not in err
    # the same typos typed on the command line keep the command line's spelling
    err = _short(capsys, ["fit", "--config", DIGITS, "--trainer.callbacks.init_args.max_grad_nrom=1"])
    assert "did you mean --trainer.callbacks.init_args.max_grad_norm?" in err and ".yaml, line" not in err
