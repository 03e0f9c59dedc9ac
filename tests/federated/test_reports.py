"""The federated round's figures and tables (lightning_dp/federated/reports.py), as pure functions."""

import torch

from lightning_dp.federated import reports
from lightning_dp.federated.local_dp_sgd import ClientPlan


def test_record_table_has_one_row_per_client():
    table = reports.record_table([("a", 1.23456789, None, ClientPlan(5, 0.25, 1.5), 2),
                                  ("b", 0.0, 3.0, ClientPlan(4, 1.0, 2.0), 0)])
    assert table.splitlines() == [
        "client\tepsilon\tbudget\tnoise_multiplier\tsample_rate\tsteps_per_participation\tparticipations",
        "a\t1.23457\tinf\t1.5\t0.25\t5\t2", "b\t0\t3\t2\t1\t4\t0"]


def test_spend_and_cosine_tables():
    assert reports.spend_table(clients=3, median=0.5, maximum=1.0, cost_per_participation=0.25) == (
        "clients\t3\nmedian\t0.5\nmax\t1\ncost_per_participation\t0.25\n")
    assert reports.cosine_table([(0, 0.5, -0.1)]) == "round\tupdate_cosine\tgradient_cosine\n0\t0.5\t-0.1\n"


def test_figures():
    assert reports.spend_histogram([0.1, 0.2, 0.2], xlabel="eps", title="t").axes[0].get_xlabel() == "eps"
    assert reports.cosine_figure([(0, 0.5, 0.1), (1, 0.4, 0.2)], update_name="sgd").axes[0].get_title().endswith("(sgd)")
    history = [{"releases": torch.randn(4, 2), "hypotheses": torch.randn(2, 2)} for _ in range(3)]
    assert len(reports.parameter_figure(history, 2).axes[0].lines) == 2
