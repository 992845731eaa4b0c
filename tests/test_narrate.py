"""The "what we saw" sentences: the comparison word follows the values, never the other way round."""

import pytest

from labkit import narrate


def test_the_word_follows_the_ordering_so_a_slower_run_is_never_called_faster():
    assert narrate.times(2.31, 1.0) == "2.31x faster"
    assert narrate.times(1.0, 2.5) == "2.50x slower"
    assert narrate.times(1.01, 1.0) == "about the same"
    assert narrate.times(30.0, 1.0, more="more bytes", less="fewer bytes") == "30.0x more bytes"


def test_share_is_a_percentage_of_the_whole():
    assert narrate.share(0.37, 1.0) == "37% of"


@pytest.mark.parametrize("value, baseline", [(0.0, 1.0), (1.0, float("nan")), (-1.0, 1.0)])
def test_ratios_of_nothing_are_refused(value, baseline):
    with pytest.raises(ValueError, match="must be finite and > 0"):
        narrate.times(value, baseline)


def test_saw_prints_the_sentences_under_their_heading(capsys):
    assert narrate.saw("Two ranks ran 1.3x faster.", "The link hid.") == "Two ranks ran 1.3x faster. The link hid."
    assert capsys.readouterr().out.startswith("What we saw: Two ranks ran 1.3x faster. The link hid.")
    with pytest.raises(ValueError, match="at least one non-empty sentence"):
        narrate.saw("")
