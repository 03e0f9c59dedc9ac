"""RestoreBestWeights: the module ends fit with the best checkpoint's weights; clear errors otherwise."""

import mlflow
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_dp.callbacks import RestoreBestWeights
from lightning_dp.tracking import MLFlowLogger
from tests.helpers import BlobsData, Classifier, trainer


class NoisyVal(Classifier):
    """Validation score that is best at epoch 1 of 4, whatever the weights: the last weights are not the best."""

    def validation_step(self, batch, batch_idx):
        self.log("val/score", [3.0, 0.5, 2.0, 4.0][self.current_epoch])


def fit(tmp_path, **kwargs):
    torch.manual_seed(0)
    model = NoisyVal(lr=0.5)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/score", mode="min", save_top_k=1)
    t = trainer(max_epochs=4, enable_checkpointing=True, callbacks=[ckpt, RestoreBestWeights()], **kwargs)
    t.fit(model, BlobsData())
    return model, ckpt, t


def test_module_holds_the_best_checkpoint_weights(tmp_path):
    model, ckpt, t = fit(tmp_path)
    assert "epoch=1" in ckpt.best_model_path and t.current_epoch == 4
    best = torch.load(ckpt.best_model_path, weights_only=False)["state_dict"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, best[name]), name


def test_best_checkpoint_is_logged_to_mlflow(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="restore", tracking_uri=uri, artifact_location=str(tmp_path / "art"))
    _, ckpt, _ = fit(tmp_path, logger=logger)
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(logger.run_id)
    assert run.data.params["best_checkpoint/monitor"] == "val/score"
    assert float(run.data.params["best_checkpoint/score"]) == 0.5
    names = [a.path for a in client.list_artifacts(logger.run_id, "model")]
    assert names == ["model/best.ckpt"]
    logged = torch.load(client.download_artifacts(logger.run_id, "model/best.ckpt", str(tmp_path)), weights_only=False)
    local = torch.load(ckpt.best_model_path, weights_only=False)
    # public: the weights of the best checkpoint, without its resume state
    assert "callbacks" in local and not {"callbacks", "optimizer_states", "lr_schedulers"} & set(logged)
    assert all(torch.equal(v, logged["state_dict"][k]) for k, v in local["state_dict"].items())


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(MisconfigurationException, match="needs a ModelCheckpoint with a monitor"):
        trainer(enable_checkpointing=True, callbacks=[RestoreBestWeights()]).fit(Classifier(), BlobsData())
    two = [ModelCheckpoint(dirpath=tmp_path, monitor="a"), ModelCheckpoint(dirpath=tmp_path, monitor="b"),
           RestoreBestWeights()]
    with pytest.raises(MisconfigurationException, match="RestoreBestWeights\\(monitor=...\\)"):
        trainer(enable_checkpointing=True, callbacks=two).fit(Classifier(), BlobsData())
    with pytest.raises(MisconfigurationException, match="monitor='c'.*found monitors: \\['a', 'b'\\]"):
        trainer(enable_checkpointing=True, callbacks=two[:2] + [RestoreBestWeights("c")]).fit(Classifier(), BlobsData())
    with pytest.raises(ValueError, match="metric name"):
        RestoreBestWeights(monitor="")
