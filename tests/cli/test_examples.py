"""The examples/ scripts run end to end on a tiny converted model and head."""

import importlib.util
import re
from pathlib import Path

import pytest

from tests.cli.test_generate_cli import aligned_model_dir, head_dir, model_dir  # noqa: F401  (fixtures)

EXAMPLES = Path(__file__).parents[2] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["generate", "device_loop"])
def test_an_example_generates_and_reports_its_acceptance(name, aligned_model_dir, head_dir, capsys):  # noqa: F811
    load_example(name).main(["--model", str(aligned_model_dir), "--draft", str(head_dir), "--prompt", "hello there",
                             "--max-new-tokens", "12"])
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"\d+ tokens.*acceptance length (\d+\.\d\d)", out[-1]), out
    assert float(out[-1].rsplit(" ", 1)[1]) >= 1.0
