"""Every third-party module the package imports comes from a distribution it declares.

The test extra pulls in more than a plain install has (the OpenTelemetry SDK and OTLP
exporter bring opentelemetry-proto with them), so the rest of the suite would pass with a
missing core dependency; a user's `pip install crosstrace && crosstrace demo` would not.
"""
import ast
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib

from .conftest import REPO

PACKAGE_DIRS = ("crosstrace", "tracer", "collector", "clock_sync", "proto")
DEV_ONLY = {os.path.join("proto", "generate.py")}   # regenerates the protobuf code; needs grpcio-tools


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imports(path: str) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)   # a submodule or a name
    return names


def _origin(module: str) -> str | None:
    """The file a module (or the module holding a name) comes from; namespace packages
    such as `opentelemetry` have none of their own."""
    while module:
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.origin not in (None, "namespace"):
            return spec.origin
        module = module.rpartition(".")[0]
    return None


def _distribution(module: str, origin: str, by_top: dict[str, list[str]]) -> str | None:
    """The distribution that installed `origin`: the one behind the module's top-level name,
    or for a namespace package shared by several (opentelemetry, google), the one whose
    files hold it."""
    candidates = by_top.get(module.split(".")[0], [])
    if len(candidates) == 1:
        return candidates[0].lower().replace("_", "-")
    origin = os.path.realpath(origin)
    for name in candidates:
        dist = importlib.metadata.distribution(name)
        if any(os.path.realpath(dist.locate_file(f)) == origin for f in dist.files or ()):
            return name.lower().replace("_", "-")
    return None


def test_every_imported_distribution_is_declared():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    declared = {_name(r) for r in project["dependencies"]} | {_name(r) for r in project["optional-dependencies"]["torch"]}
    by_top = importlib.metadata.packages_distributions()
    undeclared = {}
    for folder in PACKAGE_DIRS:
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for file in files:
                path = os.path.join(root, file)
                if not file.endswith(".py") or os.path.relpath(path, REPO) in DEV_ONLY:
                    continue
                for module in _imports(path):
                    top = module.split(".")[0]
                    if top in sys.stdlib_module_names or top in ("crosstrace",):
                        continue
                    origin = _origin(module)
                    assert origin, f"{path} imports {module}, which is not installed"
                    dist = _distribution(module, origin, by_top)
                    if dist not in declared:
                        undeclared.setdefault(dist or module, set()).add(os.path.relpath(path, REPO))
    assert not undeclared, f"imported but not in pyproject's dependencies (or the torch extra): {undeclared}"


def test_python_started_in_the_clone_imports_the_clone():
    """Python started in the clone's root (a script saved there, a REPL) imports the clone's
    `crosstrace` folder before the installed package; after the quick start's plain install
    that failed with "No module named 'crosstrace.proto'". The editable install's finder is
    taken away here, as a plain install has none."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
            "import crosstrace.tracer.provider, crosstrace.collector.report\n"
            "print(crosstrace.__file__); print(crosstrace.collector.report.__file__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [os.path.join(REPO, "crosstrace", "__init__.py"),
                                     os.path.join(REPO, "collector", "report.py")]
