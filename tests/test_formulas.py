"""The Korthikanti et al. 2022 closed forms, checked against hand-computed values."""

import pytest

from slackswap.errors import ConfigError
from slackswap.formulas import (
    korthikanti_bwd_flops_per_layer,
    korthikanti_fwd_flops_per_layer,
    korthikanti_saved_bytes_per_layer,
)


def test_saved_bytes_bert_large_by_hand():
    # s=512, b=8, h=1024, a=16: sbh = 4_194_304; 34*sbh = 142_606_336; 5*a*s^2*b = 167_772_160.
    assert korthikanti_saved_bytes_per_layer(512, 8, 1024, 16) == 142_606_336 + 167_772_160


def test_saved_bytes_matches_the_paper_form_when_it_is_integral():
    s, b, h, a = 1024, 4, 1600, 25  # 5*a*s/h = 80 exactly
    assert korthikanti_saved_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)


def test_fwd_flops_by_hand():
    # b=1, s=2, h=3: 24*1*2*9 + 4*1*4*3 = 432 + 48
    assert korthikanti_fwd_flops_per_layer(2, 1, 3) == 480
    assert korthikanti_bwd_flops_per_layer(2, 1, 3) == 960


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes_name_the_field(bad):
    with pytest.raises(ConfigError, match=r"seq_len="):
        korthikanti_saved_bytes_per_layer(bad, 1, 64, 4)
    with pytest.raises(ConfigError, match=r"hidden_size="):
        korthikanti_fwd_flops_per_layer(8, 1, bad)
