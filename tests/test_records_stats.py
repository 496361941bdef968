"""gptlab/records/stats.py: Welch's t-test, its p-value and interval, against scipy where it is
installed and against hand-computed values where it is not."""

import math

import pytest

from gptlab.errors import GptlabError
from gptlab.records import stats

A = [1.0, 1.2, 0.9]
B = [2.0, 2.3, 2.1, 1.8]


def test_welch_matches_a_hand_computation():
    """t = (mean a - mean b) / sqrt(va/na + vb/nb), df by Welch-Satterthwaite, computed here."""
    ma, mb = sum(A) / 3, sum(B) / 4
    va = sum((x - ma) ** 2 for x in A) / 2
    vb = sum((x - mb) ** 2 for x in B) / 3
    se2 = va / 3 + vb / 4
    df = se2**2 / ((va / 3) ** 2 / 2 + (vb / 4) ** 2 / 3)
    w = stats.welch(A, B)
    assert w.t == pytest.approx((ma - mb) / math.sqrt(se2), rel=1e-12)
    assert w.df == pytest.approx(df, rel=1e-12)
    assert w.diff == pytest.approx(ma - mb)
    # Student's t with 1 degree of freedom is Cauchy: P(|T| >= t) = 1 - 2 atan(t) / pi
    assert stats.t_two_sided(1.7, 1.0) == pytest.approx(1 - 2 * math.atan(1.7) / math.pi, rel=1e-10)
    # ... and with 2: P(|T| >= t) = 1 - t / sqrt(2 + t^2)
    assert stats.t_two_sided(0.8, 2.0) == pytest.approx(1 - 0.8 / math.sqrt(2.64), rel=1e-10)
    assert stats.t_quantile(0.975, 2.0) == pytest.approx(4.302652729911275, rel=1e-9)


@pytest.mark.parametrize(
    "a, b",
    [
        (A, B),
        ([2.4409, 2.4453, 2.4570], [2.7292, 2.7452, 2.7634]),
        ([1.0, 1.1], [1.05, 0.9, 1.2, 1.01, 0.98]),
        ([0.0, 10.0, 3.0], [4.0, 4.1]),
    ],
)
def test_welch_matches_scipy(a, b):
    scipy_stats = pytest.importorskip("scipy.stats")
    ref = scipy_stats.ttest_ind(a, b, equal_var=False)
    w = stats.welch(a, b)
    assert w.t == pytest.approx(ref.statistic, rel=1e-10)
    assert w.p_value == pytest.approx(ref.pvalue, rel=1e-8, abs=1e-14)
    assert w.df == pytest.approx(ref.df, rel=1e-10)
    low, high = ref.confidence_interval(0.95)
    assert (w.low, w.high) == (pytest.approx(low, rel=1e-8), pytest.approx(high, rel=1e-8))


def test_mean_std_and_the_edges():
    assert stats.mean([1.0, 2.0, 3.0]) == 2.0
    assert stats.std([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert stats.std([5.0]) is None
    same = stats.welch([1.0, 1.0], [1.0, 1.0])  # no spread, no difference: nothing to see
    assert same.p_value == 1.0 and same.diff == 0.0
    apart = stats.welch([1.0, 1.0], [2.0, 2.0])  # no spread, a difference: certain
    assert apart.p_value == 0.0 and apart.diff == -1.0
    with pytest.raises(GptlabError, match="at least 2 seeds per side"):
        stats.welch([1.0], [1.0, 2.0])
