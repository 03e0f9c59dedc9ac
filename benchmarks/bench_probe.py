"""Seconds DPSGD's batch probe takes at the start of a fit (its batches of 3, 5 and 7 and the two of the independence
check), per model of ``bench_dp_step.py``, median of 3 one-step fits, for the code at ``ROOT`` (default: this
checkout; another commit's worktree to compare).

    OMP_NUM_THREADS=1 python benchmarks/bench_probe.py digits_mlp mnist_cnn lstm gpt2
"""
import logging
import os
import statistics
import sys
import time
import warnings

root = os.environ.get("ROOT", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, root)
sys.path.insert(0, os.path.join(root, "benchmarks"))
warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import bench_dp_step as B  # noqa: E402
import lightning_dp.callbacks.batch_probe as bp  # noqa: E402
from lightning_dp.callbacks import DPSGD  # noqa: E402


class _Module(L.LightningModule):
    def __init__(self, net, loss):
        super().__init__()
        self.net, self.loss = net, loss

    def training_step(self, batch, batch_idx):
        return self.loss(self.net(batch[0]), batch).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """The probe's median seconds per model named in ``argv``."""
    names = sys.argv[1:] if argv is None else argv
    spent: list[float] = []
    original = bp.probe

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    bp.probe = timed
    out = {}
    try:
        for name in names:
            make_model, make_batch, batch_size, loss = B.MODELS[name]
            x, y = make_batch(512, torch.Generator().manual_seed(0))
            times = []
            for _ in range(3):
                spent.clear()
                trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, accelerator="cpu",
                                    callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
                trainer.fit(_Module(make_model(), loss), DataLoader(TensorDataset(x, y), batch_size=batch_size))
                times.append(sum(spent))
            out[name] = statistics.median(times)
            print(f"{name}: probe {out[name]:.3f} s (runs {[round(v, 3) for v in times]})", flush=True)
    finally:
        bp.probe = original
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
