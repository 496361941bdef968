"""gptlab/scaling/fit.py: known laws are recovered, and what cannot be fitted is one line."""

from __future__ import annotations

import numpy as np
import pytest

from gptlab.errors import GptlabError
from gptlab.scaling import fit

# Chinchilla's fitted law (Hoffmann et al. 2022, approach 3)
LAW = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def isoflop_grid(law=LAW, budgets=(1e17, 1e18, 1e19, 1e20), sizes=7, noise=0.0, seed=0):
    """Points on isoFLOP curves of `law`, sizes from a quarter to four times each budget's N_opt."""
    rng = np.random.default_rng(seed)
    points = []
    for c in budgets:
        n_opt, _, _ = fit.optimum(law, c)
        for n in n_opt * np.geomspace(0.25, 4, sizes):
            d = c / (6 * n)
            loss = law["E"] + law["A"] / n ** law["alpha"] + law["B"] / d ** law["beta"]
            points.append(fit.Point(c, n, d, loss * (1 + noise * rng.standard_normal())))
    return points


def test_the_exponents_of_a_known_law_are_recovered_by_both_approaches():
    a_true = LAW["beta"] / (LAW["alpha"] + LAW["beta"])  # N_opt ~ C^a
    two = fit.approach2(isoflop_grid())
    assert two["a"] == pytest.approx(a_true, abs=0.03)
    assert two["b"] == pytest.approx(1 - a_true, abs=0.03)
    three = fit.approach3(isoflop_grid())
    for key in ("alpha", "beta", "E"):
        assert three[key] == pytest.approx(LAW[key], rel=0.01), key
    # another law: the fit follows it, not Chinchilla's numbers
    other = {"E": 2.0, "A": 80.0, "B": 900.0, "alpha": 0.5, "beta": 0.25}
    two = fit.approach2(isoflop_grid(other))
    assert two["a"] == pytest.approx(0.25 / 0.75, abs=0.03)


def test_noisy_points_give_intervals_that_hold_the_truth_and_a_held_out_check():
    points = isoflop_grid(noise=0.002)
    ci = fit.bootstrap(points, rounds=30, seed=1)
    a_true = LAW["beta"] / (LAW["alpha"] + LAW["beta"])
    assert ci["a"][0] - 0.03 <= a_true <= ci["a"][1] + 0.03
    assert ci["a"][0] < ci["a"][1]  # noise gives the interval a width
    held = fit.held_out(points)
    assert held["flops"] == 1e20
    assert abs(held["n_opt_error"]) < 0.25 and abs(held["loss_error"]) < 0.02
    assert fit.held_out(isoflop_grid(budgets=(1e17, 1e18))) is None  # nothing to hold out


def test_budgets_group_runs_rounded_to_whole_steps():
    points = [fit.Point(c, n, 1.0, 1.0) for c, n in ((1e17, 1), (1.04e17, 2), (1e18, 1))]
    assert [len(g) for g in fit.budgets(points).values()] == [2, 1]


def test_what_cannot_be_fitted_is_one_line_naming_why(tmp_path):
    grid = isoflop_grid()
    few = [p for p in grid if p.flops != 1e18] + [p for p in grid if p.flops == 1e18][:2]
    with pytest.raises(
        GptlabError, match=r"budget 1e\+18 FLOPs: 2 model sizes; a fit needs at least 3"
    ):
        fit.approach2(few)
    with pytest.raises(GptlabError, match="at least 2"):
        fit.approach2(isoflop_grid(budgets=(1e18,)))
    flat = [fit.Point(1e18, n, 1e18 / 6 / n, 3.0 - 0.1 * np.log(n)) for n in (1e6, 1e7, 1e8)]
    with pytest.raises(GptlabError, match="does not curve up"):
        fit.isoflop_minimum(1e18, flat)
    csv_file = tmp_path / "study.csv"
    csv_file.write_text("flops,params,loss\n1e18,1e6,3.0\n")
    with pytest.raises(GptlabError, match="no column tokens"):
        fit.read_csv(csv_file)
    csv_file.write_text("flops,params,tokens,loss\n1e18,1e6,x,3.0\n")
    with pytest.raises(GptlabError, match=r"study.csv:2: not a number"):
        fit.read_csv(csv_file)
