"""The private torch APIs Kiln uses: every one listed in components/runtime/torch_private.py, every listed one
present on the installed torch, and that torch inside the range pyproject.toml declares."""

import ast
import re
import sys
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

from components.runtime.torch_private import PRIVATE_APIS, missing

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def product_files() -> list[Path]:
    """The code users run: the trainer, models, parallelisms, components, planning, scripts and
    benchmarks (not scripts/tutorial/, teaching code, nor benchmarks/torchtitan_*.py, which run
    TorchTitan, not Kiln)."""
    files = [ROOT / "train.py"]
    for folder in ("training", "models", "parallelisms", "components", "planning"):
        files += sorted((ROOT / folder).rglob("*.py"))
    for folder in ("scripts", "benchmarks"):
        files += [f for f in sorted((ROOT / folder).glob("*.py")) if not f.name.startswith("torchtitan_")]
    return files


def is_private(name: str) -> bool:
    """_name, but not a __dunder__ (nor a bare _)."""
    return re.match(r"_[A-Za-z0-9]", name) is not None


def imported_names(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """(local name -> dotted torch path, local names of other imports); `aten = torch.ops.aten`
    style assignments count as torch names too."""
    torch_names, others = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                if alias.name.split(".")[0] == "torch":
                    torch_names[local] = alias.name if alias.asname else "torch"
                else:
                    others.add(local)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node.module.split(".")[0] == "torch":
                    torch_names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                else:
                    others.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            path = dotted(node.value, torch_names)
            if path is not None:
                torch_names[node.targets[0].id] = path
    return torch_names, others


def dotted(node: ast.AST, torch_names: dict[str, str]) -> str | None:
    """The dotted torch path an attribute chain names (`dist.x.y` -> torch.distributed.x.y), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in torch_names:
        return ".".join([torch_names[node.id], *reversed(parts)])
    return None


def kiln_names(trees: list[ast.Module]) -> set[str]:
    """Names Kiln defines itself: functions, classes, module and class variables, self/cls attributes."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return names


def is_private_path(path: str) -> bool:
    """A dotted path with a private part."""
    return any(is_private(part) for part in path.split("."))


def private_uses(source: str, own: set[str]) -> set[str]:
    """The private torch uses in one file's code (comments and docstrings aside): dotted paths, and
    `?._name` for a private attribute of some object that Kiln does not define itself."""
    tree = ast.parse(source)
    torch_names, others = imported_names(tree)
    uses = {path for path in torch_names.values() if is_private_path(path)}
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):  # `import torch.a._b` binds only `torch`
            uses |= {a.name for a in node.names if a.name.startswith("torch.") and is_private_path(a.name)}
        elif isinstance(node, ast.Attribute):
            path = dotted(node, torch_names)
            if path is not None and id(node) not in inner and is_private_path(path):  # whole chains
                uses.add(path)
            elif path is None and is_private(node.attr) and node.attr not in own and not (
                    isinstance(node.value, ast.Name) and node.value.id in {"self", "cls", *others}):
                uses.add(f"?.{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and is_private(str(node.args[1].value))):
            owner = dotted(node.args[0], torch_names)
            if owner is not None:
                uses.add(f"{owner}.{node.args[1].value}")
    return uses


def is_listed(use: str, apis: dict[str, str]) -> bool:
    """A path listed (an operator with or without `.default`), or an attribute name some entry ends in."""
    if use.startswith("?."):
        return any(path.rsplit(".", 1)[1] == use[2:] for path in apis)
    return use in apis or use.removesuffix(".default") in apis


def product_uses() -> dict[str, set[str]]:
    """Private torch uses of the product code: use -> the files it is in."""
    files = product_files()
    sources = {f: f.read_text() for f in files}
    own = kiln_names([ast.parse(s) for s in sources.values()])
    found: dict[str, set[str]] = {}
    for f, source in sources.items():
        for use in private_uses(source, own):
            found.setdefault(use, set()).add(f.relative_to(ROOT).as_posix())
    return found


def test_every_listed_private_api_exists_in_the_installed_torch():
    gone = missing()
    assert not gone, (f"torch {torch.__version__} lacks these private APIs Kiln uses (see "
                      "components/runtime/torch_private.py for where): " + ", ".join(gone))


def test_a_vanished_private_api_is_reported():
    apis = {"torch._foreach_norm": "", "torch._no_such_op": "", "torch.nn.Module._no_such_field": "",
            "torch.ops.aten._no_such_kernel": "", "torch.distributed._no_such_module.thing": ""}
    assert missing(apis) == [p for p in apis if p != "torch._foreach_norm"]


def test_every_private_torch_use_is_listed():
    unlisted = {use: files for use, files in product_uses().items() if not is_listed(use, PRIVATE_APIS)}
    assert not unlisted, ("private torch APIs used but not listed in components/runtime/torch_private.py "
                          f"(add them with where and why): {unlisted}")


def test_every_listed_private_api_is_still_used():
    uses = product_uses()
    stale = [path for path in PRIVATE_APIS if not any(is_listed(use, {path: ""}) for use in uses)]
    assert not stale, (f"listed in components/runtime/torch_private.py but no longer used (remove them): "
                       f"{stale}")


def test_the_scan_finds_each_kind_of_private_use():
    source = '''
"""torch._in_a_docstring is not a use."""
import torch
import torch.testing._internal.fake_thing
from torch.distributed._tools import (
    helper,
)
aten = torch.ops.aten
# torch._in_a_comment is not a use
x = torch._C._hidden(1)
y = aten._kernel.default
mesh._flatten("dp")
hasattr(torch, "_maybe")
self._own = 1
z = obj._own + torch.__version__
'''
    assert private_uses(source, own={"_own"}) == {
        "torch.testing._internal.fake_thing", "torch.distributed._tools.helper", "torch._C._hidden",
        "torch.ops.aten._kernel.default", "?._flatten", "torch._maybe"}


def test_listing_matches_whole_paths_operators_and_attribute_names():
    apis = {"torch.ops.aten._kernel": "", "torch.distributed.device_mesh.DeviceMesh._flatten": ""}
    assert is_listed("torch.ops.aten._kernel.default", apis)
    assert is_listed("?._flatten", apis)
    assert not is_listed("torch.ops.aten._kernel_backward", apis)
    assert not is_listed("?._unflatten", apis)


def torch_requirement() -> Requirement:
    """The torch requirement pyproject.toml declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return next(r for r in map(Requirement, project["dependencies"]) if r.name == "torch")


def test_installed_torch_is_in_the_declared_range():
    spec = torch_requirement().specifier
    assert any(s.operator == "<" for s in spec), f"torch {spec}: no upper bound (the tested range)"
    assert spec.contains(Version(torch.__version__)), (
        f"torch {torch.__version__} is outside pyproject.toml's tested range torch{spec}")


def test_readme_install_commands_pin_a_torch_in_the_declared_range():
    pins = re.findall(r"torch==([\w.+]+)", (ROOT / "README.md").read_text())
    spec = torch_requirement().specifier
    assert pins, "README.md pins no torch version"
    outside = [p for p in pins if not spec.contains(Version(p))]
    assert not outside, f"README.md pins torch {outside}, outside pyproject.toml's torch{spec}"


def test_each_entry_says_where_it_is_used():
    vague = [path for path, where in PRIVATE_APIS.items() if not re.search(r"\w+\.py", where)]
    assert not vague, f"entries that do not name the file using them: {vague}"
