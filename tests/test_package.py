"""minfer as an installed package: every file it reads at run time ships in its wheel."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minfer"


def test_runtime_data_lies_where_the_wheel_takes_it():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["package-data"]["minfer"]
    shipped = {path for pattern in patterns for path in PACKAGE.glob(pattern) if path.is_file()}
    data = {path for path in PACKAGE.rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts}
    assert data, "minfer ships its tokenizer and text, so there is data to check"
    assert data <= shipped, f"outside minfer/assets and minfer/data, the wheel would leave out: {sorted(data - shipped)}"
