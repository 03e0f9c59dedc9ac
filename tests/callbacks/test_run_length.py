"""DPSGD's plan against the Trainer's limits (lightning_dp/callbacks/run_length.py), without a Trainer."""

import doctest

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_dp.callbacks.run_length as run_length
from lightning_dp.callbacks.run_length import LIGHTNING_DEFAULT_MAX_EPOCHS, Lengths
from lightning_dp.privacy.planning import DataFacts

DATA = DataFacts.of(dataset_size=1000, batch_size=100, world_size=1, parts=1, poisson_sampling=True)  # 10 steps/epoch


def lengths(epochs=None, max_steps=None, calibrate_for="auto", trainer_max_epochs=None, trainer_max_steps=-1,
            poisson_sampling=True):
    return Lengths(epochs, max_steps, calibrate_for, poisson_sampling, trainer_max_epochs, trainer_max_steps)


@pytest.fixture
def infos(monkeypatch):
    messages = []
    monkeypatch.setattr(run_length, "rank_zero_info", lambda message, *a, **k: messages.append(message))
    return messages


def test_module_example():
    assert doctest.testmod(run_length).failed == 0


@pytest.mark.parametrize("calibrate_for, expected", [("auto", 20), ("trainer", 30), ("callback", 20)])
def test_planned_events_follow_calibrate_for(calibrate_for, expected):
    assert lengths(epochs=2, calibrate_for=calibrate_for, trainer_max_epochs=3).planned_events(DATA) == expected


def test_agreeing_lengths_say_nothing(infos):
    assert lengths(epochs=2, trainer_max_epochs=2).resolve(DATA, target_epsilon=1.0, who="DPSGD") == 20
    assert lengths(max_steps=7).resolve(DATA, target_epsilon=1.0, who="DPSGD") == 7  # no Trainer limit
    assert infos == []


def test_a_longer_trainer_is_refused_under_auto_with_every_way_out():
    with pytest.raises(MisconfigurationException) as err:
        lengths(max_steps=15, trainer_max_epochs=2).resolve(DATA, target_epsilon=3.0, who="OnlineSensitivity")
    text = str(err.value)
    assert text.startswith("OnlineSensitivity plans 15 steps (max_steps=15) but the Trainer runs up to 2 epochs "
                           "(Trainer max_epochs=2, 20 steps)")
    assert "--trainer.max_steps=15" in text and "--trainer.callbacks.init_args.max_steps=20" in text
    assert "calibrate_for='trainer'" in text and "'callback'" in text


def test_lightnings_implicit_limit_leaves_the_plan_in_charge(infos):
    plan = lengths(epochs=2, trainer_max_epochs=LIGHTNING_DEFAULT_MAX_EPOCHS)
    assert plan.implicit_limit and plan.resolve(DATA, target_epsilon=1.0, who="DPSGD") == 20
    (message,) = infos
    assert "Lightning's default max_epochs=1000, so the plan ends the run" in message


def test_a_shorter_trainer_is_calibrated_for_and_told(infos):
    assert lengths(epochs=6, trainer_max_epochs=2).resolve(DATA, target_epsilon=2.0, who="DPSGD") == 20
    (message,) = infos
    assert message.startswith("DPSGD: the Trainer stops after 2 epochs (Trainer max_epochs=2, 20 steps), DPSGD "
                              "planned 6 epochs (epochs=6, 60 steps)")
    # for a script and for the command line, each named as such (issue 50, item 6)
    assert "DPSGD(epochs=2) (in lightning-dp, for the last callback, --trainer.callbacks.init_args.epochs=2)" in message


def test_calibrating_for_the_callback_says_what_the_fit_spends(infos):
    assert lengths(epochs=2, calibrate_for="callback", trainer_max_epochs=3).resolve(
        DATA, target_epsilon=2.0, who="DPSGD") == 20
    assert lengths(epochs=4, calibrate_for="callback", trainer_max_epochs=3).resolve(
        DATA, target_epsilon=2.0, who="DPSGD") == 40
    assert infos[0].endswith("is stopped by the budget at DPSGD's plan.")
    assert infos[1].endswith("spends less than target_epsilon.")


def test_no_agreeing_epochs_when_the_trainer_stops_mid_epoch(infos):
    lengths(epochs=6, trainer_max_epochs=2, trainer_max_steps=15).resolve(DATA, target_epsilon=2.0, who="DPSGD")
    (message,) = infos
    assert "15 steps (Trainer max_steps=15)" in message and "DPSGD's epochs=null" in message


def test_shuffled_batches_count_epochs():
    plan = lengths(max_steps=25, trainer_max_epochs=2, poisson_sampling=False, calibrate_for="trainer")
    assert plan.own_events(DATA) == 3 and plan.trainer_events(DATA) == 2 and plan.planned_events(DATA) == 2


def test_check_epochs_refuses_before_any_data_only_what_it_can_tell():
    with pytest.raises(MisconfigurationException, match=r"DPSGD plans 2 epochs \(epochs=2\) but the Trainer runs "
                                                        r"up to 3 epochs \(Trainer max_epochs=3\)"):
        lengths(epochs=2, trainer_max_epochs=3).check_epochs(target_epsilon=1.0, who="DPSGD")
    for fine in (lengths(epochs=2, trainer_max_epochs=2),
                 lengths(epochs=2, trainer_max_epochs=3, calibrate_for="trainer"),
                 lengths(epochs=2, trainer_max_epochs=3, trainer_max_steps=100),  # needs the steps per epoch
                 lengths(max_steps=5, trainer_max_epochs=3), lengths(epochs=2, trainer_max_epochs=1000)):
        fine.check_epochs(target_epsilon=1.0, who="DPSGD")
