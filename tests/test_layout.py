"""The project's layout promises: two import names installed, thin command-line scripts that import no other script,
small library modules, every library package installed, console entry points that resolve."""

import ast
import importlib.metadata
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
MAX_SCRIPT_LINES = 100
MAX_MODULE_LINES = 450


def _non_blank_lines(path: pathlib.Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def _pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_only_the_model_and_the_library_are_importable_outside_the_source_tree(tmp_path):
    code = ("import importlib.util as u, sys; "
            "names = ['scripts', 'model_cards', 'benchmarks', 'hf_recurrent', 'trainer_ext', 'trainer_ext.cli', "
            "'trainer_ext.hub.model_cards']; "
            "print({n: u.find_spec(n) is not None for n in names})")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # what the install provides
    found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           check=True)
    assert ast.literal_eval(found.stdout.strip()) == {
        "scripts": False, "model_cards": False, "benchmarks": False, "hf_recurrent": True, "trainer_ext": True,
        "trainer_ext.cli": True, "trainer_ext.hub.model_cards": True}


def test_every_library_package_is_installed():
    config = _pyproject()["tool"]["setuptools"]
    packages, mapped = set(config["packages"]), config["package-dir"]
    on_disk = {".".join(init.parent.relative_to(REPO).parts) for root in ("hf_recurrent", "trainer_ext")
               for init in (REPO / root).rglob("__init__.py")}
    on_disk |= set(mapped)
    assert packages == on_disk


@pytest.mark.parametrize("script", sorted((REPO / "scripts").glob("*.py")), ids=lambda p: p.name)
def test_scripts_are_thin_and_import_no_other_script(script):
    assert _non_blank_lines(script) <= MAX_SCRIPT_LINES
    tree = ast.parse(script.read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {name for name in imported if name.split(".")[0] in ("scripts", "benchmarks")}
    assert not {name for name in imported if name.startswith("trainer_ext.cli")}


def test_library_modules_stay_small():
    modules = [path for root in ("hf_recurrent", "trainer_ext") for path in (REPO / root).rglob("*.py")]
    too_long = {str(path.relative_to(REPO)): n for path in modules if (n := _non_blank_lines(path)) > MAX_MODULE_LINES}
    assert not too_long


def test_console_entry_points_resolve_to_the_cli_package():
    scripts = _pyproject()["project"]["scripts"]
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
                 if ep.name.startswith("hf-recurrent-")}
    assert installed == scripts
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert module.startswith("trainer_ext.cli."), name
        assert callable(getattr(importlib.import_module(module), function)), name


def test_main_classes_are_importable_from_the_library_root():
    import trainer_ext
    from trainer_ext.training.arguments import RecurrentTrainingArguments
    from trainer_ext.optim.optimizer import LowMemoryAdafactor
    from trainer_ext.training.trainer import RecurrentTrainer

    assert trainer_ext.RecurrentTrainer is RecurrentTrainer
    assert trainer_ext.RecurrentTrainingArguments is RecurrentTrainingArguments
    assert trainer_ext.LowMemoryAdafactor is LowMemoryAdafactor
    with pytest.raises(AttributeError, match="no_such_name"):
        trainer_ext.no_such_name
