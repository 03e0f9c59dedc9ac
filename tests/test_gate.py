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


@pytest.mark.parametrize("bar", ["rich", "tqdm"])
def test_the_logger_version_shows_as_an_integer(tmp_path, bar):
    """Issue 50, item 4: Rich's bar formats every number as a metric, so a CSV or TensorBoard logger's version 1 read
    ``v_num: 1.000``; TQDM's shows an int as it is (and pads a string of digits, so it keeps the int)."""
    pytest.importorskip("rich")
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    progress = RichProgressBar() if bar == "rich" else TQDMProgressBar()
    shown = []

    class Bar(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            shown.append(trainer.progress_bar_callback.get_metrics(trainer, trainer.lightning_module)["v_num"])

    CSVLogger(tmp_path, name="run").log_metrics({"x": 1.0})  # version 0 taken: the run below is version 1
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=CSVLogger(tmp_path, name="run"),
                        enable_model_summary=False, max_epochs=1, limit_train_batches=2, limit_val_batches=0,
                        default_root_dir=tmp_path,
                        callbacks=[DPSGD(noise_multiplier=1.0, seed=0, log_nonprivate_metrics=False), progress, Bar()])
    trainer.fit(Classifier(loss_name="nonprivate/loss"), BlobsData())
    assert trainer.logger.version == 1
    assert shown == (["1", "1"] if bar == "rich" else [1, 1])
    if bar == "rich":
        assert progress.train_progress_bar_id is not None  # the bar ran: its metrics column got "v_num: 1"


def test_the_last_validation_stays_on_the_bar_and_ends_the_summary(tmp_path, capsys):
    """Issue 50, item 4: under DPSGD the bar dropped val/acc during training (the gate admits val/* only while
    evaluating) and the summary had no validation row: the DP run's accuracy never reached the terminal."""
    shown = []

    class Bar(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            shown.append(set(trainer.progress_bar_callback.get_metrics(trainer, trainer.lightning_module)))

    class AccuracyOnTheBar(Classifier):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val/acc", (self(x).argmax(1) == y).float().mean(), prog_bar=True)

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_model_summary=False, max_epochs=2,
                        log_every_n_steps=1, enable_progress_bar=True, default_root_dir=tmp_path,
                        callbacks=[DPSGD(noise_multiplier=1.0, seed=0, log_nonprivate_metrics=False), Bar()])
    trainer.fit(AccuracyOnTheBar(loss_name="nonprivate/loss"), BlobsData())
    assert "val/acc" in shown[-1] and "privacy/epsilon" in shown[-1]  # epoch 1: epoch 0's validation on the bar
    acc = float(trainer.callback_metrics["val/acc"])
    assert f"  val/acc           {acc:.4g} (last validation)" in capsys.readouterr().out


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


# ------------------------------------------------------- names checked before the first private step (issue 49)
class _NewUser(Classifier):
    """What a new user's module logs in ``training_step``: the loss per step, the accuracy per epoch, a dict."""

    def __init__(self, loss="train_loss", acc="train_acc", extra=None):
        super().__init__()
        self.names, self.extra = (loss, acc), dict(extra or {})

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.log(self.names[0], loss)
        self.log(self.names[1], (logits.argmax(1) == y).float().mean(), on_epoch=True)
        if self.extra:
            self.log_dict(self.extra)
        self.log("shown_only", 1.0, prog_bar=True, logger=False)  # reaches no logger: never written, not refused
        return loss


def _dpsgd_trainer(logger, **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, logger=logger, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, max_epochs=1, log_every_n_steps=1,
                     callbacks=[DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, **kwargs)])


def _fit_with(trainer, module, via):
    if via == "datamodule":
        trainer.fit(module, BlobsData())
    else:
        data = BlobsData()
        data.setup("fit")
        trainer.fit(module, train_dataloaders=data.train_dataloader())


@pytest.mark.parametrize("via", ["datamodule", "train_dataloaders"])
def test_every_undeclared_name_of_training_step_is_refused_in_one_error_before_the_first_private_step(via):
    """``train_loss`` (per step) and ``train_acc`` (on_epoch=True) used to be refused one at a time, at the first write
    (step 50, the end of epoch 0), after private steps had run. The batch probe learns them, with Lightning's
    ``_step``/``_epoch`` names, and all are refused before the first optimizer step, each with the gate's own fix."""
    recorder, module = RecordingLogger(), _NewUser()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = _dpsgd_trainer(recorder)
    with pytest.raises(gate.UndeclaredRecordError) as refused:
        _fit_with(trainer, module, via)
    message = str(refused.value)
    assert "_NewUser.training_step logs 3 metric(s)" in message
    # one line each, with the gate's fix: rename what the module logs (train_acc for Lightning's train_acc_step)
    for name, logged in [("train_loss", "train_loss"), ("train_acc_step", "train_acc"),
                         ("train_acc_epoch", "train_acc")]:
        assert re.search(rf"^- '{name}'.*would write the metric '{name}'.*log it as 'nonprivate/{logged}'.*"
                         rf"declare\('{name}'", message, re.MULTILINE)
    assert "- 'train_acc_step' (logged as 'train_acc'): " in message
    assert "shown_only" not in message
    dp = trainer.callbacks[0]
    assert trainer.global_step == 0 and len(dp.accountant.history) == 0 and dp._released == 0  # no private step
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))  # parameters unchanged
    assert recorder.calls == []  # no metric written (the run's configuration, params, was)


def test_log_dict_and_names_declared_for_others_are_refused_with_the_rest():
    with pytest.raises(gate.UndeclaredRecordError) as refused:
        _fit_with(_dpsgd_trainer(RecordingLogger()),
                  _NewUser(loss="nonprivate/train_loss", acc="train_acc", extra={"val/acc": 1.0, "grad_norm": 2.0,
                                                                                   "nonprivate/x": 3.0}), "datamodule")
    message = str(refused.value)
    assert "logs 4 metric(s)" in message
    assert "- 'val/acc': the run would write the metric 'val/acc', which the record's table " in message
    assert "admits only while the trainer validates or tests" in message
    assert "- 'grad_norm': " in message and "- 'train_acc_epoch' (logged as 'train_acc'): " in message


@pytest.mark.parametrize("via", ["datamodule", "train_dataloaders"])
def test_a_module_logging_declared_and_nonprivate_names_trains_as_before(via):
    """The names check adds nothing to the record and draws nothing: the same seed trains the same parameters as a
    module that logs nothing, and the probe's own calls of training_step reach no logger."""
    class Counts(_NewUser):
        def training_step(self, batch, batch_idx):
            self.log("nonprivate/examples", float(batch[0].shape[0]), on_step=False, on_epoch=True, reduce_fx="sum")
            return super().training_step(batch, batch_idx)

    class Silent(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x), y)

    class Seen(L.Callback):
        examples = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            Seen.examples += batch[0].shape[0]

    trained = []
    for module in (Counts(loss="nonprivate/train_loss", acc="nonprivate/train_acc"), Silent()):
        torch.manual_seed(0)
        module.net.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
        recorder = RecordingLogger()
        trainer = _dpsgd_trainer(recorder)
        trainer.callbacks.append(Seen())
        Seen.examples = 0
        _fit_with(trainer, module, via)
        assert trainer.global_step == 10
        trained.append([p.detach().clone() for p in module.parameters()])
        if isinstance(module, Counts):
            assert {"nonprivate/train_loss", "nonprivate/train_acc_step", "nonprivate/train_acc_epoch",
                    "privacy/epsilon"} <= recorder.names()
            assert recorder.series("nonprivate/examples") == [Seen.examples]  # not the probe's 3 + 5 + 7 more
    assert all(torch.equal(a, b) for a, b in zip(*trained))


def test_names_are_not_checked_where_nothing_is_written_or_dropped_by_the_switch():
    trainer = _dpsgd_trainer(False)  # no logger: no metric reaches the record
    trainer.fit(_NewUser(), BlobsData())
    assert trainer.global_step == 10
    trainer = _dpsgd_trainer(RecordingLogger(), log_nonprivate_metrics=False)
    trainer.fit(_NewUser(loss="nonprivate/train_loss", acc="nonprivate/train_acc"), BlobsData())
    assert trainer.global_step == 10


def test_a_name_logged_in_an_epoch_end_hook_is_refused_when_written():
    """The probe runs training_step only: a name the module logs in on_train_epoch_end is not learned before the
    first step (its hooks act on real steps and state the probe cannot restore); the gate refuses it at its write."""
    class AtEpochEnd(Classifier):
        def on_train_epoch_end(self):
            self.log("train_epoch_stat", 1.0)

    recorder = RecordingLogger()
    trainer = _dpsgd_trainer(recorder)
    with pytest.raises(gate.UndeclaredRecordError, match="metric 'train_epoch_stat' to the record"):
        trainer.fit(AtEpochEnd(), BlobsData())
    assert trainer.global_step == 10 and "train_epoch_stat" not in recorder.names()
