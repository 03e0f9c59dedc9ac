"""target_epsilon's enforcement (lightning_dp/callbacks/budget.py) against the accountant, without a Trainer."""

from lightning_dp.callbacks.budget import Budget
from lightning_dp.privacy.accounting import get_accountant


def test_allowed_events_fit_in_the_budget_and_one_more_does_not():
    accountant, budget = get_accountant("rdp"), Budget()
    assert not budget.spent  # no budget yet
    assert budget.update((1.0, 0.05), accountant=accountant, target_epsilon=2.0, target_delta=1e-5, planned=None)
    n = budget.allowed
    assert n > 0 and not budget.plan_done
    for _ in range(n):
        assert not budget.spent
        accountant.step(noise_multiplier=1.0, sample_rate=0.05)
        budget.take()
    assert budget.spent and accountant.get_epsilon(1e-5) <= 2.0
    accountant.step(noise_multiplier=1.0, sample_rate=0.05)
    assert accountant.get_epsilon(1e-5) > 2.0


def test_the_same_event_is_not_recomputed_and_a_new_one_restarts_the_count():
    accountant, budget = get_accountant("rdp"), Budget()
    budget.update((1.0, 0.05), accountant=accountant, target_epsilon=2.0, target_delta=1e-5, planned=None)
    budget.take()
    assert not budget.update((1.0, 0.05), accountant=accountant, target_epsilon=2.0, target_delta=1e-5, planned=None)
    assert budget.taken == 1
    assert budget.update((1.0, 0.1), accountant=accountant, target_epsilon=2.0, target_delta=1e-5, planned=None)
    assert budget.taken == 0 and budget.event == (1.0, 0.1)


def test_a_plan_shorter_than_the_budget_ends_first():
    accountant, budget = get_accountant("rdp"), Budget()
    budget.update((2.0, 0.01), accountant=accountant, target_epsilon=10.0, target_delta=1e-5, planned=30)
    assert budget.allowed == 30 and budget.plan_done
    budget.stopped_at = 30
    budget.start()
    assert budget.event is None and budget.stopped_at is None and budget.allowed == 30
