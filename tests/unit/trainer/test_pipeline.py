"""The layer split over pipeline stages."""

import pytest

from trainer.pipeline import stage_layers


@pytest.mark.parametrize("num_layers,pp", [(4, 1), (4, 2), (4, 3), (4, 4), (7, 3), (12, 5)])
def test_split_is_contiguous_complete_and_even(num_layers, pp):
    stages = stage_layers(num_layers, pp)
    assert len(stages) == pp
    assert [i for r in stages for i in r] == list(range(num_layers))
    sizes = [len(r) for r in stages]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)  # the last stage also carries head and loss


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError):
        stage_layers(2, 3)
