"""The project's layout promises: two import names installed, thin command-line scripts that import no other script,
small library modules, every library package installed, console entry points that resolve, the library's
sub-packages by concern with their dependencies pointing one way, and no import cycles."""

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


@pytest.mark.parametrize("name, target", sorted(_pyproject()["project"]["scripts"].items()))
def test_every_console_entry_point_prints_its_help(name, target, capsys):
    # argparse formats each help text with %: a bare % in one (say "1.3% faster") breaks --help for the whole command.
    module, _, function = target.partition(":")
    with pytest.raises(SystemExit) as exit_:
        getattr(importlib.import_module(module), function)(["--help"])
    assert exit_.value.code in (0, None) and "usage:" in capsys.readouterr().out


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _library_imports() -> dict[str, set[str]]:
    """{module: the library modules it imports}, read from the source: every import statement, at module level or
    inside a function or an `if TYPE_CHECKING:` block, absolute or relative. `from package import name` counts as
    importing `package.name` where that is a module."""
    modules = {_module_name(path): path
               for root in ("hf_recurrent", "trainer_ext") for path in (REPO / root).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                imported |= {base} | {f"{base}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = {module for module in imported if module in modules and module != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`: each strongly connected set of two or more modules (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _package(module: str) -> str:
    """The library sub-package (or base module) a module belongs to: `trainer_ext.optim`, `trainer_ext.files`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "trainer_ext" and len(parts) > 1 else parts[0]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_the_library():
    assert _cycles(_library_imports()) == []


# The cut of the library, by what each sub-package is, and what each may import of the others (the base modules,
# data and the model are below all of them). Dependencies point one way: down this table.
SUB_PACKAGES = {
    "trainer_ext.optim": set(),
    "trainer_ext.distill": set(),
    "trainer_ext.memory": {"trainer_ext.optim", "trainer_ext.distill"},
    "trainer_ext.training": {"trainer_ext.optim", "trainer_ext.memory", "trainer_ext.distill"},
    "trainer_ext.lr_search": {"trainer_ext.training", "trainer_ext.optim", "trainer_ext.memory",
                              "trainer_ext.distill"},
    "trainer_ext.evaluation": {"trainer_ext.distill"},
    "trainer_ext.hub": set(),
    "trainer_ext.run": {"trainer_ext.training", "trainer_ext.lr_search", "trainer_ext.optim", "trainer_ext.memory",
                        "trainer_ext.distill", "trainer_ext.hub", "trainer_ext.evaluation"},
    "trainer_ext.comparison": {"trainer_ext.run", "trainer_ext.training", "trainer_ext.lr_search", "trainer_ext.optim",
                               "trainer_ext.memory", "trainer_ext.distill", "trainer_ext.hub",
                               "trainer_ext.evaluation"},
}
BASE = {"hf_recurrent", "trainer_ext", "trainer_ext.data", "trainer_ext.files", "trainer_ext.devices",
        "trainer_ext.checkpoints", "trainer_ext.compat", "trainer_ext.lm_head", "trainer_ext.cli",
        "trainer_ext.progress"}


def test_the_library_is_cut_into_sub_packages_that_say_their_job():
    on_disk = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "trainer_ext").glob("*/__init__.py")}
    assert on_disk == set(SUB_PACKAGES) | {"trainer_ext.data"}
    for package in SUB_PACKAGES:
        init = REPO / package.replace(".", "/") / "__init__.py"
        if package in ("trainer_ext.optim", "trainer_ext.memory", "trainer_ext.training", "trainer_ext.lr_search",
                       "trainer_ext.run"):
            assert len(ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or "") > 100, package


def test_sub_packages_import_only_what_lies_below_them():
    graph = _library_imports()
    crossing = {}
    for module, imported in graph.items():
        package = _package(module)
        if package not in SUB_PACKAGES:
            continue
        for other in imported:
            target = _package(other)
            if target != package and target not in BASE and target not in SUB_PACKAGES[package]:
                crossing.setdefault(module, set()).add(other)
    assert not crossing
    # The optimizer and the planner import nothing of the training machine nor of what is built on it.
    above = {"trainer_ext.training", "trainer_ext.lr_search", "trainer_ext.run", "trainer_ext.comparison"}
    for module, imported in graph.items():
        if _package(module) in ("trainer_ext.optim", "trainer_ext.memory"):
            assert not {other for other in imported if _package(other) in above}, module


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
