"""The README's optax quickstart runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).parents[1] / "README.md"


def test_readme_optax_quickstart_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    quickstart = next(b for b in blocks if "tx = ls.dynamic(optax.adamw(1e-3))" in b)
    namespace: dict = {}
    exec(compile(quickstart, str(README), "exec"), namespace)
    assert int(namespace["opt_state"].good_steps) == 1
    assert "32768.0" in capsys.readouterr().out
