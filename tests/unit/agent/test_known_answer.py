"""The known-answer comparison's allowances (agent/known_answer.py compare): a float32 graph is held
to 0.2% of the largest logit, a call with int8 activations to 10%, and an int8 call past its
allowance is told apart (the agent then says to serve with float32 activations, not to clear a
compile cache)."""

import numpy as np
import pytest

from agent.known_answer import Int8AllowanceError, KnownAnswerError, compare


def test_each_arithmetic_is_held_to_its_allowance_of_the_largest_logit():
    expected = np.array([10.0, -2.0, 3.0], np.float32)
    compare("decode", expected + 0.019, expected, "float32")
    with pytest.raises(KnownAnswerError, match=r"max \|difference\| 0.021, allowed 0.02") as caught:
        compare("decode", expected + 0.021, expected, "float32")
    assert not isinstance(caught.value, Int8AllowanceError)
    compare("decode", expected + 0.99, expected, "int8")
    with pytest.raises(Int8AllowanceError, match=r"the mixed graph .* allowed 1\b"):
        compare("mixed", expected + 1.01, expected, "int8")


def test_a_non_finite_output_fails_whatever_the_allowance():
    expected = np.ones(4, np.float32)
    for dtype in ("float32", "int8"):
        with pytest.raises(KnownAnswerError):
            compare("prefill", np.array([1, np.nan, 1, 1], np.float32), expected, dtype)
