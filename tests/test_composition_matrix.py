"""The composition matrix stays whole: every (entry point, feature) cell is
run by ``test_composition_steppers.py`` / ``test_composition_gradients.py``
or excluded with a reason in ``tests/composition.py``, never both."""

import loss_scale as ls
from tests import composition as c


def test_every_cell_is_run_or_excluded_with_a_reason():
    entries = [*c.STEPPERS, *c.GRADIENTS, "report:range_report"]
    run = set(c.run_cells("stepper") + c.run_cells("gradient") + c.run_cells("report"))
    excluded = {(e, f): r for e, f, r in c.excluded_cells()}
    for entry in entries:
        for feature in c.FEATURES:
            assert ((entry, feature) in run) != ((entry, feature) in excluded), (entry, feature)
    assert all(len(reason) > 20 for reason in excluded.values())
    assert len(run) + len(excluded) == len(entries) * len(c.FEATURES)


def test_every_public_entry_point_is_in_the_matrix():
    names = {e.split(":", 1)[1].split("(")[0] for e in [*c.STEPPERS, *c.GRADIENTS, "report:range_report"]}
    factories = {"dynamic", "predictive", "static", "no_op", "for_dtype", "apply_gradients"}
    functions = {"value_and_grad", "value_grad_and_peak", "range_report"}
    presets = {f"presets.{name}" for name in ls.presets.__all__}
    assert factories | functions | presets <= names
    if c.HAVE_FLAX:
        assert {"flax.TrainState", "flax.Optimizer", "flax.nnx_value_and_grad"} <= names
    if c.HAVE_EQUINOX:
        assert {"equinox.apply_gradients", "equinox.filter_value_and_grad"} <= names


def test_every_feature_is_exercised_somewhere():
    run = c.run_cells("stepper") + c.run_cells("gradient") + c.run_cells("report")
    assert {f for _, f in run} == set(c.FEATURES)
