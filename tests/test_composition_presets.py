"""The composition matrix's cells of the presets (``ls.presets.*``): each
preset x every JAX feature, against the bare optimizer (the cells are those
of ``test_composition_steppers.py``)."""

import pytest

from tests import composition as c
from tests.test_composition_steppers import check_stepper_cell

CELLS = [(e, f) for e, f in c.run_cells("stepper") if e.startswith("stepper:presets.")]


@pytest.mark.parametrize(("entry", "feature"), CELLS, ids=[f"{e}-{f}" for e, f in CELLS])
def test_preset_cell(entry, feature, tmp_path):
    check_stepper_cell(entry, feature, tmp_path)
