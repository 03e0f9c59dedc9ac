"""lightning-dp epsilon: the printed epsilon equals dp-accounting's own accountants on the same DP-SGD event,
a calibrated sigma fits its target tightly, and bad input lists every problem and exits with 2; and the entry
points (``lightning-dp --version``, ``python -m lightning_dp``)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import dp_accounting
import pytest

from lightning_dp import cli
from lightning_dp.commands.epsilon import epsilon_table


def _printed(capsys):
    out = capsys.readouterr().out
    return out, [float(x) for x in re.findall(r"\| \d+ \| [\d.]+ \| ([\d.]+) \|", out)]


def _library(accountant, sigma, q, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.compose(event).get_epsilon(delta)


def test_epsilon_equals_dp_accountings_pld_and_rdp(capsys):
    assert cli.main(["epsilon", "--dataset-size", "60000", "--batch-size", "256", "--epochs", "3",
                     "--noise-multiplier", "1.1"]) == 0
    out, table = _printed(capsys)
    steps = 3 * 235  # ceil(60000 / 256)
    want = _library(dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4), 1.1, 256 / 60000, steps,
                    1e-5)
    assert f"{steps} steps" in out and table[-1] == pytest.approx(want, abs=1e-4)  # printed to 4 decimals
    assert table == sorted(table)  # epsilon grows along the run
    rdp = epsilon_table(noise_multiplier=1.1, sample_rate=0.01, steps=500, delta=1e-5, accountant="rdp")
    want = _library(dp_accounting.rdp.RdpAccountant(), 1.1, 0.01, 500, 1e-5)
    assert rdp[-1] == (500, pytest.approx(want, rel=1e-3))


def test_a_calibrated_sigma_fits_its_target_within_one_percent(capsys):
    assert cli.main(["epsilon", "--sample-rate", "0.01", "--steps", "1000", "--target-epsilon", "2"]) == 0
    out, table = _printed(capsys)
    sigma = float(re.search(r"noise_multiplier = ([\d.]+)", out).group(1))
    assert table[-1] <= 2.0
    loose = epsilon_table(noise_multiplier=sigma / 1.011, sample_rate=0.01, steps=1000, delta=1e-5, fractions=(1,))
    assert loose[0][1] > 2.0  # 1 % less noise would exceed the target (calibration tolerance 1 %)


def test_replacement_adjacency_costs_more():
    add = epsilon_table(noise_multiplier=1.0, sample_rate=0.02, steps=200, delta=1e-5, fractions=(1,))
    rep = epsilon_table(noise_multiplier=1.0, sample_rate=0.02, steps=200, delta=1e-5, fractions=(1,),
                        adjacency="replace")
    assert rep[0][1] > add[0][1]


def test_bad_input_lists_every_problem_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["epsilon", "--epochs", "3", "--steps", "4", "--noise-multiplier", "-1", "--delta", "2",
                  "--adjacency", "replace", "--accountant", "rdp"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for text in ("--sample-rate Q, or --dataset-size N", "exactly one of --epochs", "--noise-multiplier=-1.0",
                 "--delta=2.0", "needs --accountant pld"):
        assert text in err


def test_version_and_python_dash_m():
    import subprocess
    import sys

    import lightning_dp

    out = subprocess.run([sys.executable, "-m", "lightning_dp", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"lightning-dp {lightning_dp.__version__}"
    out = subprocess.run([sys.executable, "-m", "lightning_dp", "epsilon", "--sample-rate", "0.5", "--steps", "2",
                          "--noise-multiplier", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "epsilon = " in out.stdout


# --------------------------------------------------------------------------- DP-FedAvg (client-level)


def _fedavg_printed(out):
    return [float(x) for x in re.findall(r"^\| \d+ \| [\d.]+ \| ([\d.]+) \|$", out, flags=re.MULTILINE)]


def _train_dp_fedavg(server_privacy, *, q, rounds, num_clients):
    """A tiny DP-FedAvg run (tests/federated/test_dp_fedavg.py's set-up): the privacy/epsilon it logs each round."""
    import lightning as L

    from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
    from lightning_dp.federated import FederatedRound
    from lightning_dp.federated.parts import FedAvg, LocalSGD, PoissonSelection
    from lightning_dp.models import LinearRegression

    logged = []

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            logged.append(float(trainer.callback_metrics["privacy/epsilon"]))

    module = FederatedRound(LinearRegression(), selection=PoissonSelection(q), update=LocalSGD(epochs=1, lr=0.1,
                            batch_size=10), aggregator=FedAvg(), server_privacy=server_privacy, seed=0, noise_seed=1)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, max_epochs=rounds, num_sanity_val_steps=0, limit_val_batches=0,
                        log_every_n_steps=1, callbacks=[Capture()])
    trainer.fit(module, SyntheticLinearMixtureDataModule(num_clients=num_clients, num_val_clients=2, seed=0))
    assert trainer.global_step == rounds
    return logged


def test_dp_fedavg_epsilon_equals_what_the_training_logs(capsys):
    """40 training clients, 10 a round (q = 0.25), z = 1.3, 4 rounds: the table's rows (rounds 1..4) are the
    privacy/epsilon the run logs after each round, exactly (and to the 4 printed decimals)."""
    from lightning_dp.commands.epsilon import client_epsilon_table, client_level_privacy
    from lightning_dp.federated.parts import CentralGaussian

    assert cli.main(["epsilon", "--clients", "40", "--clients-per-round", "10", "--rounds", "4",
                     "--noise-multiplier", "1.3"]) == 0
    out = capsys.readouterr().out
    printed = _fedavg_printed(out)
    assert "client-level epsilon = " in out and "q = 0.25 (U = 10 expected of N = 40 clients)" in out
    assert "PoissonSelection, init_args: {sample_rate: 0.25}" in out and "add_remove adjacency" in out

    privacy = CentralGaussian(noise_multiplier=1.3, clip=0.5)
    logged = _train_dp_fedavg(privacy, q=0.25, rounds=4, num_clients=40)
    assert privacy.accountant.history == [(1.3, 0.25, 4)]  # the event the calculator accounts
    ours = client_epsilon_table(client_level_privacy(client_sample_rate=10 / 40, rounds=4, delta=1e-5,
                                                     noise_multiplier=1.3), rounds=4)
    table = [e for _, e in ours]
    assert printed == [round(e, 4) for e in table] and len(logged) == 4
    assert table == _accountants_epsilons("add_remove", 1.3, 0.25, 4)  # the run's accountant after each round
    assert table[-1] == logged[-1] == privacy.epsilon  # the run's final write, bit-identical
    assert logged[:-1] == _accountants_epsilons("add_remove", 1.3, 0.25, 3, interim=True)  # its interim writes


def test_dp_fedavg_calibrated_z_is_the_trainings_under_replacement(capsys):
    """--target-epsilon: the calculator's z is the one the training calibrates itself (same CentralGaussian.plan),
    here under replacement, and the run's final epsilon is the table's last row."""
    from lightning_dp.commands.epsilon import client_epsilon_table, client_level_privacy
    from lightning_dp.federated.parts import CentralGaussian

    assert cli.main(["epsilon", "--client-sample-rate", "0.3", "--rounds", "6", "--target-epsilon", "2",
                     "--adjacency", "replace"]) == 0
    out = capsys.readouterr().out
    printed_z = float(re.search(r"noise_multiplier = ([\d.]+) for client-level epsilon <= 2;", out).group(1))
    printed = _fedavg_printed(out)
    assert "replace adjacency (one client's data replaced by another's" in out

    privacy = CentralGaussian(target_epsilon=2.0, clip=1.0, adjacency="replace")
    logged = _train_dp_fedavg(privacy, q=0.3, rounds=6, num_clients=30)
    ours = client_level_privacy(client_sample_rate=0.3, rounds=6, delta=1e-5, target_epsilon=2.0, adjacency="replace")
    assert ours.z == privacy.z and privacy.accountant.history == [(privacy.z, 0.3, 6)]
    assert printed_z == math.ceil(privacy.z * 1e4) / 1e4  # printed rounded up
    table = [e for _, e in client_epsilon_table(ours, rounds=6, fractions=(1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1))]
    assert table == _accountants_epsilons("replace", privacy.z, 0.3, 6)
    assert table[-1] == logged[-1] and printed[-1] == round(logged[-1], 4) and logged[-1] <= 2.0
    assert logged[:-1] == _accountants_epsilons("replace", privacy.z, 0.3, 5, interim=True)


def _accountants_epsilons(adjacency, z, q, rounds, *, interim=False):
    """The PLD accountant's epsilon after 1..rounds rounds; ``interim``: what a run writes before its last round
    (Accountant.interim_epsilon, the coarser upper bound)."""
    from lightning_dp.privacy.accounting import get_accountant

    out = []
    for r in range(1, rounds + 1):
        accountant = get_accountant("pld", adjacency=adjacency)
        accountant.step(noise_multiplier=z, sample_rate=q, num_steps=r)
        out.append(accountant.interim_epsilon(1e-5) if interim else accountant.get_epsilon(1e-5))
    return out


def _library_event_epsilon(accountant, z, q, rounds, delta):
    return accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)).get_epsilon(delta)


@pytest.mark.parametrize("accountant,adjacency", [("pld", "add_remove"), ("rdp", "add_remove"), ("pld", "replace")])
def test_dp_fedavg_epsilon_equals_dp_accountings_own_accountant(capsys, accountant, adjacency):
    """The same event composed by hand in dp-accounting: R rounds of the Poisson-subsampled Gaussian (z, q)."""
    from dp_accounting import NeighboringRelation

    argv = ["epsilon", "--clients", "1000", "--clients-per-round", "50", "--rounds", "100", "--noise-multiplier",
            "1.0", "--accountant", accountant, "--adjacency", adjacency]
    assert cli.main(argv) == 0
    printed = _fedavg_printed(capsys.readouterr().out)
    relation = NeighboringRelation.ADD_OR_REMOVE_ONE if adjacency == "add_remove" else NeighboringRelation.REPLACE_ONE

    def library():  # a fresh one per row: compose() accumulates
        return (dp_accounting.pld.PLDAccountant(relation) if accountant == "pld"
                else dp_accounting.rdp.RdpAccountant(neighboring_relation=relation))

    assert [round(_library_event_epsilon(library(), 1.0, 0.05, r, 1e-5), 4) for r in (25, 50, 75, 100)] == printed
    # the same number as the DP-SGD mode for the same (sigma, q, steps): one round is one DP-SGD step's event
    assert printed[-1] == round(epsilon_table(noise_multiplier=1.0, sample_rate=0.05, steps=100, delta=1e-5,
                                              accountant=accountant, adjacency=adjacency, fractions=(1,))[0][1], 4)


def test_dp_fedavg_calibrated_z_fits_its_target_and_z_over_1_01_does_not(capsys):
    from lightning_dp.commands.epsilon import client_level_privacy

    assert cli.main(["epsilon", "--clients", "100", "--clients-per-round", "20", "--rounds", "100",
                     "--target-epsilon", "4", "--delta", "1e-3"]) == 0
    out = capsys.readouterr().out
    z = float(re.search(r"noise_multiplier = ([\d.]+)", out).group(1))
    assert _fedavg_printed(out)[-1] <= 4.0

    def spend(multiplier):
        privacy = client_level_privacy(client_sample_rate=0.2, rounds=100, delta=1e-3, noise_multiplier=multiplier)
        return privacy.planned_epsilon(multiplier, 100, None, None)

    assert spend(z) <= 4.0 < spend(z / 1.01)  # the printed (rounded-up) z fits; 1 % less noise does not


def test_dp_fedavg_bad_input_lists_every_problem_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["epsilon", "--clients", "10", "--clients-per-round", "20", "--client-sample-rate", "1.5",
                  "--batch-size", "8", "--noise-multiplier", "1", "--target-epsilon", "0", "--accountant", "rdp",
                  "--adjacency", "replace"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for text in ("--batch-size: DP-SGD options do not mix with the DP-FedAvg options",
                 "--client-sample-rate OR --clients-per-round, not both", "--clients-per-round=20 exceeds --clients=10",
                 "--client-sample-rate=1.5: must be in (0, 1]", "give --rounds R", "exactly one of --noise-multiplier",
                 "--target-epsilon=0.0: must be > 0", "needs --accountant pld when q < 1"):
        assert text in err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["epsilon", "--rounds", "0", "--clients", "0", "--noise-multiplier", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for text in ("give --client-sample-rate Q, or --clients N with --clients-per-round U", "--clients=0: must be >= 1",
                 "--rounds=0: must be >= 1"):
        assert text in err
    # RDP under replacement is refused only with sampling: every client in every round (q = 1) is accounted
    assert cli.main(["epsilon", "--client-sample-rate", "1", "--rounds", "10", "--noise-multiplier", "5",
                     "--accountant", "rdp", "--adjacency", "replace"]) == 0


def test_the_note_on_a_delta_not_below_one_over_n_is_the_trainings_warning_and_silent_below(capsys):
    """lightning-dp epsilon prints the warning the training would give (lightning_dp.privacy.delta), once, on
    stdout, and no Python warning besides; delta < 1/N prints no note."""
    import warnings

    from lightning_dp.privacy.delta import LargeDeltaWarning, check_delta_for_size

    with warnings.catch_warnings():
        warnings.simplefilter("error", LargeDeltaWarning)  # the part's own warning is replaced by the note
        assert cli.main(["epsilon", "--clients", "10", "--clients-per-round", "5", "--rounds", "3",
                         "--noise-multiplier", "1", "--delta", "0.3"]) == 0
        out = capsys.readouterr().out
        note = f"note: the training would warn: {check_delta_for_size(0.3, 10, unit='clients', who='CentralGaussian')}"
        assert out.count("note: ") == 1 and note in out.splitlines()
        assert cli.main(["epsilon", "--dataset-size", "50", "--batch-size", "5", "--epochs", "1",
                         "--noise-multiplier", "1", "--delta", "0.05"]) == 0
        out = capsys.readouterr().out
        assert f"note: the training would warn: {check_delta_for_size(0.05, 50)}" in out.splitlines()
        assert "DPSGD: target_delta=0.05 is not below 1/N = 0.02 (N = 50 training examples)" in out
        for args in (["--clients", "10", "--clients-per-round", "5", "--rounds", "3", "--delta", "0.099"],
                     ["--dataset-size", "50", "--batch-size", "5", "--epochs", "1", "--delta", "0.019"],
                     ["--sample-rate", "0.1", "--steps", "3", "--delta", "0.5"]):  # N unknown: nothing to say
            assert cli.main(["epsilon", *args, "--noise-multiplier", "1"]) == 0
            assert "note: " not in capsys.readouterr().out


def test_an_epoch_is_ceil_n_over_b_steps_and_opacus_count_is_one_flag_away(capsys):
    """Issue 50, item 10: the numbers the help and docs state for N = 60000, B = 256, 60 epochs, sigma 1.1 (PLD):
    2.3852 with the training's ceil(N / B) = 235 steps an epoch, 2.3796 with Opacus' int(1 / q) = 234."""
    args = ["epsilon", "--dataset-size", "60000", "--batch-size", "256", "--epochs", "60", "--noise-multiplier", "1.1"]
    assert cli.main(args) == 0
    out, table = _printed(capsys)
    assert "14100 steps (60 epochs of 235)" in out and f"{table[-1]:.4f}" == "2.3852"
    assert cli.main([*args, "--epoch-steps", "floor"]) == 0
    out, table = _printed(capsys)
    assert "14040 steps (60 epochs of 234, Opacus' int(1 / q))" in out and f"{table[-1]:.4f}" == "2.3796"
    with pytest.raises(SystemExit):
        cli.main(["epsilon", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "ceil(N / B) = ceil(1 / q) steps" in help_text and "Opacus counts int(1 / q)" in help_text
    assert "2.3852 with ceil, 2.3796 with floor" in help_text


def test_a_user_level_epsilon_is_dp_accountings_mixture_and_group_privacy_states_more(capsys):
    """Issue 51: --max-examples-per-user K answers per user (ELS): dp-accounting's MixtureOfGaussiansDpEvent with
    sensitivities 0..K and Binomial(K, q) weights, written out here; --user-accounting group states more."""
    from scipy import stats

    args = ["epsilon", "--sample-rate", "0.05", "--steps", "40", "--noise-multiplier", "2.0",
            "--max-examples-per-user", "3"]
    assert cli.main(args) == 0
    out, mixture = _printed(capsys)
    event = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(2.0, [0, 1, 2, 3], list(stats.binom.pmf(range(4), 3, 0.05)))
    want = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(
        dp_accounting.SelfComposedDpEvent(event, 40)).get_epsilon(1e-5)
    assert "per user, at most 3 records each (mixture of Gaussians)" in out
    assert mixture[-1] == pytest.approx(want, abs=1e-4)
    assert cli.main([*args, "--user-accounting", "group"]) == 0
    _, group = _printed(capsys)
    assert group[-1] > mixture[-1]
    with pytest.raises(SystemExit) as stop:
        cli.main([*args, "--accountant", "rdp"])
    assert stop.value.code == 2
    assert "--max-examples-per-user needs --accountant pld" in capsys.readouterr().err


def test_the_privacy_unit_section_of_the_docs_runs_as_written(capsys):
    """docs/privacy.md, "The privacy unit": its commands and its dp-accounting recomputation, as written."""
    import doctest
    import shlex
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    section = page.split("## The privacy unit", 1)[1].split("\n## ", 1)[0]
    commands = [line for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.splitlines()]
    assert len(commands) == 3
    printed = []
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "lightning-dp" and cli.main(argv[1:]) == 0
        printed.append(_printed(capsys)[1][-1])
    assert printed[0] == pytest.approx(6.69, abs=0.005) and printed[1] == pytest.approx(8.22, abs=0.005)  # the text
    assert printed[2] == pytest.approx(0.64, abs=0.005)  # ULS: the example-level spend with users for examples
    (pycon,) = re.findall(r"```pycon\n(.*?)```", section, re.S)
    test = doctest.DocTestParser().get_doctest(pycon, {}, "privacy-unit", "docs/privacy.md", 0)
    assert doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE).run(test).failed == 0


def test_user_sampling_is_the_sampled_gaussian_at_the_users_rate(capsys):
    """--sampling user (ULS): the example-level event with users for examples; refused without K or with an ELS
    statement."""
    args = ["epsilon", "--dataset-size", "1000", "--batch-size", "50", "--steps", "30", "--noise-multiplier", "1.2"]
    assert cli.main([*args, "--max-examples-per-user", "4", "--sampling", "user"]) == 0
    out, users = _printed(capsys)
    assert "users sampled and clipped as units" in out
    want = _library(dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4), 1.2, 0.05, 30, 1e-5)
    assert users[-1] == pytest.approx(want, abs=1e-4)
    for extra, message in ((["--sampling", "user"], "needs --max-examples-per-user"),
                           (["--sampling", "user", "--max-examples-per-user", "4", "--user-accounting", "group"],
                            "drop --user-accounting")):
        with pytest.raises(SystemExit):
            cli.main([*args, *extra])
        assert message in capsys.readouterr().err


def test_batches_of_one_shape_are_the_librarys_truncated_event(capsys):
    """docs/privacy.md, "Batches of one shape": the command as written there."""
    from lightning_dp.privacy.sampling import suggest_max_batch_size

    command = ("lightning-dp epsilon --dataset-size 60000 --batch-size 256 --epochs 10 --noise-multiplier 1 "
               "--max-batch-size auto")
    assert f"`{command}`" in (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    assert cli.main(command.split()[1:]) == 0
    out, table = _printed(capsys)
    bound = suggest_max_batch_size(60000, 256 / 60000)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.TruncatedSubsampledGaussianDpEvent(60001, 256 / 60000, bound, 1.0), 2350)
    want = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-5)
    assert bound == 335 and f"at most {bound} examples" in out and table[-1] == pytest.approx(want, abs=1e-4)
    with pytest.raises(SystemExit) as err:
        cli.main(["epsilon", "--sample-rate", "0.01", "--steps", "10", "--noise-multiplier", "1", "--accountant", "rdp",
                  "--max-batch-size", "x"])
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert "needs --dataset-size N and --batch-size B" in message and "--accountant pld" in message
    assert "a whole number >= 1 or 'auto'" in message
