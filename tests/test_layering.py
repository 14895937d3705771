"""The shape of the code, held by a test (DESIGN §2): who may import whom, and how big things get.

Layers, bottom up: ``resilient`` (core) <- ``storage`` <- ``recovery`` <- ``trainer`` <- ``tools``.
``storage.offline`` may import the storage runtime; the runtime never imports offline. ``chaos``
sits beside ``tools``: it may use the core, storage, recovery and the trainer's recipe loader
(``resilient.trainer.config``), and nothing imports it except ``tools`` and the tests (the trainer
reaches its step hook by a dotted path in the config, never by an import). Lazy imports inside
functions count the same as top-level ones.

Size budget: no source file (benchmarks included) over 500 lines, no function over 60 (STYLE.md);
what must be longer is named in ``LONG_FUNCTIONS`` with the reason.

Seams: no module imports another module's ``_private`` names (a split that needs them is one
concern cut in two; tests share helpers as public names of a helper module), and no two modules
of one folder import each other, directly or round a circle (imports under ``if TYPE_CHECKING:``
aside).

Faces: a package in ``FACED_PACKAGES`` is imported through its ``__init__`` from everywhere outside
it (source, tools, benchmarks, examples and tests alike); only its own modules and its own tests
(``tests/`` + the package's path, which test its internals) import its modules.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "resilient": "",
    "storage": "storage",
    "recovery": "recovery",
    "trainer": "trainer",
    "tools": "tools",
    "chaos": "chaos",
}  # folder -> the layer name under ``resilient.``
ORDER = ["", "storage", "recovery", "trainer", "tools"]
FACES = ("resilient", "resilient.dcp")
"""Core modules that are public faces only: the package's ``__init__`` and ``resilient.dcp`` (what a
DCP user imports; its code is ``resilient.storage.dcp``). They may import storage to re-export it."""
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS: dict[str, str] = {}
"""``"path::function"`` -> why it is longer than MAX_FUNCTION_LINES (keep this short)."""
PRIVATE_IMPORTS: dict[str, str] = {}
"""``"path::name"`` -> why that module may import another's private name (keep this empty)."""
ALLOWED_CIRCLES: dict[str, str] = {}
"""``"a <-> b"`` (sorted) -> why those modules import each other (keep this empty)."""
LONG_FILES: dict[str, str] = {}
"""``"path"`` -> why that file is longer than MAX_FILE_LINES (keep this empty)."""
FACED_PACKAGES = ("resilient.recovery.ram", "resilient.recovery.channel")
"""Packages whose ``__init__`` exports what the rest of the code uses (the RAM tier; the channel
every tier shares): nobody outside imports ``<package>.<module>``."""
FACE_EXCEPTIONS: dict[str, str] = {
    "tests/recovery/ram/workers.py::resilient.recovery.channel.wire": "a RAM restore test counts the buffers "
    "a buddy fetch lands in by replacing wire.fresh_buffer (the in-place receive is the behaviour under test)",
    "tests/recovery/test_transport.py::resilient.recovery.channel.wire": "a heal test lowers "
    "wire.MAPPED_BUFFER_MIN_BYTES so a small state takes the mapped-buffer path",
}
"""``"path::module"`` -> why that file imports a module behind a face (keep this short)."""
FACE_FOLDERS = ("tests", "benchmarks", "examples")
"""Checked for faces too, besides the source folders."""


@dataclass(frozen=True, slots=True)
class Import:
    path: str  # file, relative to the repo root
    line: int
    target: str  # the dotted module imported, e.g. "resilient.trainer.loop"
    name: str = ""  # for ``from M import name``: the name (target is then "M.name")
    type_checking: bool = False  # under ``if TYPE_CHECKING:`` (annotations only, no runtime edge)


def source_files(root: Path = ROOT) -> list[Path]:
    return sorted(f for folder in FOLDERS for f in (root / folder).rglob("*.py"))


def module_of(path: Path, root: Path = ROOT) -> str:
    """``storage/offline/verify.py`` -> ``resilient.storage.offline.verify``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    layer = FOLDERS[parts[0]]
    rest = [p for p in parts[1:] if p != "__init__"]
    return ".".join(["resilient", *([layer] if layer else []), *rest])


def imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = str(path.relative_to(root))
    package: list[str] = []  # outside the source folders (tests, benchmarks), relative imports never reach resilient
    if path.relative_to(root).parts[0] in FOLDERS:
        package = module_of(path, root).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
    annotations_only = _type_checking_nodes(tree)
    out = []
    for node in ast.walk(tree):
        hint = id(node) in annotations_only
        if isinstance(node, ast.Import):
            out += [Import(rel, node.lineno, alias.name, type_checking=hint) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # ``from ..trainer import loop`` resolves against this file's package, as Python does.
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            module = ".".join(p for p in (base, node.module or "") if p)
            # ``from resilient import storage`` imports the subpackage: count the names too.
            out += [Import(rel, node.lineno, f"{module}.{a.name}", a.name, hint) for a in node.names]
    return [i for i in out if i.target == "resilient" or i.target.startswith("resilient.")]


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)}
    return inside


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> str:
    """``resilient.storage.x`` -> ``storage``; ``resilient.errors`` -> ``""`` (core)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS.values() and parts[1] else ""


def violation(importer: str, target: str) -> str | None:
    """Why ``importer`` may not import ``target`` (module names), or None."""
    src, dst = layer_of(importer), layer_of(target)
    if importer in FACES and dst in ("", "storage"):
        return None  # a public face re-exports the API (Checkpointer, the DCP plugins) from storage
    if dst == "chaos":
        return None if src in ("chaos", "tools") else "only tools and the tests import chaos"
    if src == "chaos":
        if dst == "tools":
            return "chaos does not import tools"
        if dst == "trainer" and not _within(target, "resilient.trainer.config"):
            return "chaos imports only the trainer's recipe loader (resilient.trainer.config)"
        return None
    if ORDER.index(dst) > ORDER.index(src):
        return f"{src or 'core'} sits below {dst} (resilient <- storage <- recovery <- trainer <- tools)"
    offline = "resilient.storage.offline"
    if src == "storage" and not _within(importer, offline) and _within(target, offline):
        return "the storage runtime never imports storage.offline"
    return None


def layering_violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in source_files(root):
        importer = module_of(path, root)
        for imp in imports_of(path, root):
            why = violation(importer, imp.target)
            if why is not None:
                out.append(f"{imp.path}:{imp.line} imports {imp.target}: {why}")
    return out


def private_imports(root: Path = ROOT) -> list[str]:
    """``from resilient.x import _name`` in any module but ``resilient.x`` itself."""
    out = []
    for path in source_files(root):
        importer = module_of(path, root)
        for imp in imports_of(path, root):
            owner = imp.target.rsplit(".", 1)[0]
            private = imp.name.startswith("_") and not imp.name.startswith("__")
            if private and owner != importer and f"{imp.path}::{imp.name}" not in PRIVATE_IMPORTS:
                out.append(f"{imp.path}:{imp.line} imports {imp.name} from {owner}: make it public or join the two")
    return out


def private_test_imports(root: Path = ROOT) -> list[str]:
    """``from tests.x import _name`` in a test: what tests share is a public name of a helper module."""
    out = []
    for path in sorted((root / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
                rel = path.relative_to(root)
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                out += [f"{rel}:{node.lineno} imports {n} from {node.module}: make it a helper's" for n in names]
    return out


def import_circles(root: Path = ROOT) -> list[str]:
    """Modules of one folder that import each other (round a circle of any length), not allowed."""
    return [c for c in all_import_circles(root) if c not in ALLOWED_CIRCLES]


def all_import_circles(root: Path = ROOT) -> list[str]:
    files = {module_of(p, root): p for p in source_files(root)}
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        folder = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        targets = set()
        for imp in imports_of(path, root):
            target = imp.target if imp.target in files else imp.target.rsplit(".", 1)[0]
            sibling = target in files and files[target].name != "__init__.py" and target.rsplit(".", 1)[0] == folder
            if sibling and target != module and not imp.type_checking:
                targets.add(target)
        edges[module] = targets
    return [" <-> ".join(c) for c in _strongly_connected(edges) if len(c) > 1]


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each module with every module it reaches and that reaches it back (sorted, each once)."""
    reach: dict[str, set[str]] = {}
    for start in edges:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    groups = {tuple(sorted({m} | {o for o in reach[m] if m in reach[o]})) for m in edges}
    return sorted(list(g) for g in groups)


def _behind_face(target: str, root: Path) -> tuple[str, str] | None:
    """(package, module) when ``target`` is a module inside a faced package, else None."""
    for package in FACED_PACKAGES:
        if target.startswith(package + "."):
            module = ".".join(target.split(".")[: package.count(".") + 2])
            folder = root.joinpath(*module.split(".")[1:])
            if folder.with_suffix(".py").is_file() or (folder / "__init__.py").is_file():
                return package, module
    return None


def face_violations(root: Path = ROOT) -> list[str]:
    """Imports of a module behind a face (``FACED_PACKAGES``) from outside its package and its tests."""
    files = source_files(root) + sorted(f for folder in FACE_FOLDERS for f in (root / folder).rglob("*.py"))
    out = []
    for path in files:
        rel = str(path.relative_to(root))
        for imp in imports_of(path, root):
            behind = _behind_face(imp.target, root)
            if behind is None or f"{rel}::{behind[1]}" in FACE_EXCEPTIONS:
                continue
            package, module = behind
            inside = "/".join(package.split(".")[1:])
            if rel.startswith((f"{inside}/", f"tests/{inside}/")):
                continue
            out.append(f"{rel}:{imp.line} imports {module}: import it from the face, {package}")
    return out


def budget_files(root: Path = ROOT) -> list[Path]:
    return source_files(root) + sorted((root / "benchmarks").glob("*.py"))


def size_violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in budget_files(root):
        rel = str(path.relative_to(root))
        text = path.read_text()
        if (n := text.count("\n")) > MAX_FILE_LINES and rel not in LONG_FILES:
            out.append(f"{rel}: {n} lines (budget {MAX_FILE_LINES}: split it by concern)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and f"{rel}::{node.name}" not in LONG_FUNCTIONS:
                    out.append(f"{rel}:{node.lineno} {node.name}() is {length} lines (budget {MAX_FUNCTION_LINES})")
    return out


def test_imports_follow_the_layers() -> None:
    assert layering_violations() == []


def test_no_module_imports_another_s_private_names() -> None:
    assert private_imports() == []


def test_no_test_imports_another_s_private_names() -> None:
    assert private_test_imports() == []


def test_no_import_circles_inside_a_folder() -> None:
    assert import_circles() == []


def test_packages_with_a_face_are_imported_through_it() -> None:
    assert face_violations() == []


def test_every_face_exception_is_still_there() -> None:
    present = set()
    for folder in (*FOLDERS, *FACE_FOLDERS):
        for path in (ROOT / folder).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            present |= {f"{rel}::{b[1]}" for i in imports_of(path) if (b := _behind_face(i.target, ROOT))}
    assert sorted(set(FACE_EXCEPTIONS) - present) == [], "drop these from FACE_EXCEPTIONS"


def test_every_allowed_private_import_is_still_there() -> None:
    present = {f"{i.path}::{i.name}" for p in source_files() for i in imports_of(p)}
    assert sorted(set(PRIVATE_IMPORTS) - present) == [], "drop these from PRIVATE_IMPORTS"


def test_every_allowed_circle_and_long_file_is_still_there() -> None:
    assert sorted(set(ALLOWED_CIRCLES) - set(all_import_circles())) == [], "drop from ALLOWED_CIRCLES"
    for rel in LONG_FILES:
        assert (ROOT / rel).read_text().count("\n") > MAX_FILE_LINES, f"{rel}: drop it from LONG_FILES"


def test_files_and_functions_stay_within_budget() -> None:
    assert size_violations() == []


def test_every_allowed_long_function_still_exists_and_is_long() -> None:
    for key in LONG_FUNCTIONS:
        rel, name = key.split("::")
        tree = ast.parse((ROOT / rel).read_text())
        lengths = [
            n.end_lineno - n.lineno + 1
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
        ]
        assert lengths and max(lengths) > MAX_FUNCTION_LINES, f"{key}: drop it from LONG_FUNCTIONS"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in FOLDERS:
        (tmp_path / folder).mkdir(exist_ok=True)
    return tmp_path


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    """The rules fail on a tree that breaks them (a test that cannot fail proves nothing)."""
    root = _tree(
        tmp_path,
        {
            "storage/checkpointer.py": "import resilient.trainer\nfrom resilient.storage.offline import verify\n",
            "storage/offline/verify.py": "from resilient.storage import reader\n",
            "recovery/restore.py": "def f():\n    from resilient.trainer.loop import Trainer\n",
            "trainer/loop.py": "from resilient.chaos import hooks\nfrom resilient.recovery import quorum\n",
            "chaos/job.py": "from resilient.trainer.config import load_config\nfrom resilient.tools import replicas\n",
            "chaos/inject.py": "from resilient.trainer.replicated import FINAL_DIGEST\n",
            "tools/chaos.py": "from resilient.chaos import harness\n",
            "resilient/errors.py": "from resilient import storage\n",
            "resilient/__init__.py": "from resilient.storage.handle import SaveHandle\nimport resilient.chaos\n",
            "storage/reader.py": "from ..trainer import loop\nfrom . import arrays\n",
            "chaos/twin.py": "from resilient.trainer.config_x import x\nfrom resilient.trainer.config import load\n",
            "resilient/big.py": "x = 1\n" * 501 + "def f():\n" + "    y = 1\n" * 60,
        },
    )
    found = layering_violations(root)
    assert [v.split(" imports ")[0] for v in found] == [
        "chaos/inject.py:1",
        "chaos/job.py:2",
        "chaos/twin.py:1",
        "recovery/restore.py:2",
        "resilient/__init__.py:2",
        "resilient/errors.py:1",
        "storage/checkpointer.py:1",
        "storage/checkpointer.py:2",
        "storage/reader.py:1",
        "trainer/loop.py:1",
    ]
    assert "storage/reader.py:1 imports resilient.trainer.loop" in found[8]
    sizes = size_violations(root)
    assert sizes == [
        "resilient/big.py: 562 lines (budget 500: split it by concern)",
        "resilient/big.py:502 f() is 61 lines (budget 60)",
    ]


def test_the_seam_checks_catch_private_names_circles_and_long_benchmarks(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "storage/a.py": "from resilient.storage.b import _helper, public\n",
            "storage/b.py": "from resilient.storage import c\n_helper = public = 1\n",
            "storage/c.py": "def f():\n    from resilient.storage import a\n",
            "storage/d.py": "import typing\nif typing.TYPE_CHECKING:\n    from resilient.storage import e\n",
            "storage/e.py": "from resilient.storage import d\n",
            "trainer/f.py": "from resilient.storage.b import _helper\n",
            "benchmarks/big_bench.py": "x = 1\n" * 501,
            "tests/test_b.py": "from tests.test_a import _stub, public\nfrom tests.helpers import shared\n",
        },
    )
    assert private_test_imports(root) == ["tests/test_b.py:1 imports _stub from tests.test_a: make it a helper's"]
    assert private_imports(root) == [
        "storage/a.py:1 imports _helper from resilient.storage.b: make it public or join the two",
        "trainer/f.py:1 imports _helper from resilient.storage.b: make it public or join the two",
    ]
    # a -> b -> c -> a is a circle (the lazy import counts); d <-> e is not (d's import is for hints).
    assert import_circles(root) == ["resilient.storage.a <-> resilient.storage.b <-> resilient.storage.c"]
    assert size_violations(root) == ["benchmarks/big_bench.py: 501 lines (budget 500: split it by concern)"]


def test_the_face_check_catches_imports_behind_a_face(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "recovery/ram/__init__.py": "from resilient.recovery.ram.tier import RamTier\n",
            "recovery/ram/tier.py": "from resilient.recovery.ram.store import RankStore\nfrom . import store\n",
            "recovery/ram/store.py": "from resilient.recovery.channel import Scatter\n",
            "recovery/ram/buddy.py": "from resilient.recovery.channel.handler import PutTarget\n",
            "recovery/channel/__init__.py": "from resilient.recovery.channel.handler import PutTarget\n",
            "recovery/channel/handler.py": "PutTarget = 1\n",
            "recovery/restore.py": "from resilient.recovery.ram import RamTier\n",
            "trainer/loop.py": "from resilient.recovery.ram.tier import RamTier\n",
            "tools/demo.py": "def f():\n    import resilient.recovery.ram.store\n",
            "tests/recovery/ram/test_store.py": "from resilient.recovery.ram import store\n",
            "tests/chaos/test_inject.py": "from resilient.recovery.ram import store\n",
            "benchmarks/ram_bench.py": "from resilient.recovery.ram.store import node_store_dir\n",
        },
    )
    assert face_violations(root) == [
        "recovery/ram/buddy.py:1 imports resilient.recovery.channel.handler: import it from the face, "
        "resilient.recovery.channel",
        "tools/demo.py:2 imports resilient.recovery.ram.store: import it from the face, resilient.recovery.ram",
        "trainer/loop.py:1 imports resilient.recovery.ram.tier: import it from the face, resilient.recovery.ram",
        "benchmarks/ram_bench.py:1 imports resilient.recovery.ram.store: import it from the face, "
        "resilient.recovery.ram",
        "tests/chaos/test_inject.py:1 imports resilient.recovery.ram.store: import it from the face, "
        "resilient.recovery.ram",
    ]
