"""The record's gate (lightning_dp.gate): what a private run writes passes one place that knows each name."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch

from lightning_dp import gate, tracking
from lightning_dp.callbacks import DPSGD
from lightning_dp.privacy import record
from tests.helpers import BlobsData, Classifier, RecordingLogger


class _LogsNonprivate(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).float().mean())  # any name: evaluation of the released model


def _fit(module, logger, **dpsgd):
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_epochs=1, log_every_n_steps=1,
                        callbacks=[DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, **dpsgd)])
    trainer.fit(module, BlobsData())
    return trainer


def test_an_undeclared_training_metric_is_refused_before_it_is_written():
    recorder = RecordingLogger()
    with pytest.raises(gate.UndeclaredRecordError, match="'train_loss'.*nonprivate/train_loss"):
        _fit(Classifier(loss_name="train_loss"), recorder)  # what an ordinary LightningModule logs
    assert "train_loss" not in recorder.names()


class _LogsDeclared(_LogsNonprivate):
    def training_step(self, batch, batch_idx):
        self.log("custom_constant", 1.0)  # declared by the test below
        return super().training_step(batch, batch_idx)


def test_declared_and_nonprivate_metrics_pass_and_the_switch_drops_nonprivate(monkeypatch):
    with pytest.raises(gate.UndeclaredRecordError, match="custom_constant"):
        _fit(_LogsDeclared(), RecordingLogger())
    monkeypatch.setattr(record, "RECORD", list(record.RECORD))  # the declaration below stays in this test
    record.declare("custom_constant", "public", "metric", "a constant")
    on = RecordingLogger()
    trainer = _fit(_LogsDeclared(), on)
    assert {"nonprivate/train_loss", "val_acc", "custom_constant", "privacy/epsilon"} <= on.names()
    assert gate.installed(trainer) is None  # removed at teardown: the loggers are as they were
    assert "log_metrics" not in on.__dict__
    off = RecordingLogger()
    _fit(_LogsNonprivate(), off, log_nonprivate_metrics=False)
    assert not any(n.startswith("nonprivate/") for n in off.names())
    assert {"val_acc", "privacy/epsilon"} <= off.names()


def test_params_are_configuration_and_pass():
    recorder = RecordingLogger()
    _fit(_LogsNonprivate(), recorder)
    assert {"privacy/noise_multiplier", "privacy/sample_rate"} <= set(recorder.params)


def test_tags_and_artifacts_pass_the_gate(tmp_path):
    """The tracking helpers consult the gate: an undeclared tag or artifact of a private run is refused."""
    trainer = L.Trainer(logger=False)
    component = DPSGD(noise_multiplier=1.0)
    gate.install(trainer, component)
    try:
        assert gate.admit(trainer, "summary.epsilon", "tag") and gate.admit(trainer, "model/final.ckpt", "artifact")
        assert gate.admit(trainer, "nonprivate/cosine.png", "artifact")
        with pytest.raises(gate.UndeclaredRecordError, match="tag 'my_tag'"):
            tracking.set_tags(trainer, {"my_tag": 1})
        with pytest.raises(gate.UndeclaredRecordError, match="artifact 'plots/x.png'"):
            tracking.log_text(trainer, "x", "plots/x.png")
        component.log_nonprivate_metrics = False
        assert not gate.admit(trainer, "nonprivate/cosine.png", "artifact")
    finally:
        gate.uninstall(trainer, component)
    assert gate.admit(trainer, "my_tag", "tag")  # no privacy component: not gated


def test_a_non_private_run_is_not_gated():
    recorder = RecordingLogger()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=recorder, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_epochs=1, log_every_n_steps=1)
    trainer.fit(Classifier(loss_name="train_loss"), BlobsData())  # what an ordinary LightningModule logs
    assert "train_loss" in recorder.names()


def test_every_name_lightning_dp_writes_is_declared():
    """The names our components write (collected from the source) are all in the table."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "lightning_dp"
    pattern = re.compile(r'"((?:privacy|round|nonprivate|pdpfl|summary|val|test|train|federated|model)[/.][\w/.]+)"')
    names = {m for path in root.rglob("*.py") for m in pattern.findall(path.read_text())}
    # file names of datasets, a command-line example, a config path named in the deployment's refusal of secrets
    names -= {"train.csv", "test.csv", "model.init_args.lr", "model.init_args.noise_seed"}
    assert len(names) > 20
    assert record.undeclared(names) == []
    # the names that change with the setting, as the round writes them
    assert record.undeclared(["round/participants", "round/cluster_size_3", "privacy/client_epsilon.tsv",
                              "nonprivate/record_epsilon_hist.png", "train/lr", "lr-SGD"]) == []


def test_a_checkpoint_of_the_gate_leaves_no_trace_in_torch_save(tmp_path):
    """The gate lives on the trainer and the loggers' instance attributes only: nothing of it is pickled."""
    trainer = _fit(_LogsNonprivate(), RecordingLogger())
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    assert "gate" not in str(torch.load(path, weights_only=False).keys())


class _LogsUnder(Classifier):
    """Logs a statistic of the training batch under a name the table declares for someone else."""

    def __init__(self, name):
        super().__init__()
        self.name = name

    def training_step(self, batch, batch_idx):
        self.log(self.name, float(batch[0].shape[0]))  # the exact Poisson batch size
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("name", ["round/x_sum", "audit/batch_size", "privacy/batch_loss", "val/train_batch_loss",
                                  "lr-SGD", "train/lr"])
def test_a_name_declared_for_another_component_or_for_evaluation_is_refused_in_training(name):
    """round/* belongs to the federated round, audit/* to the one-run audit, val/* to evaluation, privacy/* metrics
    to the privacy components' own names: a module's training statistic under such a name is refused."""
    with pytest.raises(gate.UndeclaredRecordError, match=re.escape(repr(name))):
        _fit(_LogsUnder(name), RecordingLogger())


def test_a_monitor_of_a_training_statistic_is_refused_when_training_starts(tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    for callback in (ModelCheckpoint(monitor="nonprivate/train_loss"), EarlyStopping(monitor="train_loss")):
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, max_epochs=1,
                            callbacks=[DPSGD(noise_multiplier=1.0, seed=0), callback])
        with pytest.raises(gate.UndeclaredRecordError, match="monitors"):
            trainer.fit(Classifier(), BlobsData())
    ok = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   max_epochs=1, default_root_dir=tmp_path,
                   callbacks=[DPSGD(noise_multiplier=1.0, seed=0), ModelCheckpoint(monitor="val/acc", mode="max")])
    ok.fit(Classifier(), BlobsData())


def test_the_progress_bar_shows_only_what_the_record_may_hold(tmp_path):
    shown = []

    class Bar(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            shown.append(set(trainer.progress_bar_callback.get_metrics(trainer, trainer.lightning_module)))

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_model_summary=False, max_epochs=1,
                        log_every_n_steps=1, enable_progress_bar=True, default_root_dir=tmp_path,
                        callbacks=[DPSGD(noise_multiplier=1.0, seed=0, log_nonprivate_metrics=False), Bar()])
    class OnTheBar(Classifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("nonprivate/train_loss", loss, prog_bar=True)
            return loss

    trainer.fit(OnTheBar(loss_name="nonprivate/loss"), BlobsData())
    assert shown and not any(n.startswith("nonprivate/") for names in shown for n in names)
    assert "nonprivate/train_loss" in trainer.progress_bar_metrics  # computed, not shown


def test_a_logger_added_after_setup_is_gated():
    late = RecordingLogger()

    class AddLogger(L.Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.loggers = [*trainer.loggers, late]

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=RecordingLogger(), enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, max_epochs=1, log_every_n_steps=1,
                        callbacks=[DPSGD(noise_multiplier=1.0, seed=0, log_nonprivate_metrics=False), AddLogger()])
    trainer.fit(Classifier(), BlobsData())
    assert "privacy/epsilon" in late.names() and not any(n.startswith("nonprivate/") for n in late.names())
