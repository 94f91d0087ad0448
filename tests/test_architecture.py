"""The package's shape is a contract: layers that import only downward, no cycle, small modules and
classes."""

import ast
import configparser
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

PACKAGE = ROOT / "mpidist"


def _tool(name):
    """The command ``name`` beside this Python (the test extra installs it), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.exists(beside) else shutil.which(name)


def _lint_imports():
    return _tool("lint-imports")


@pytest.mark.parametrize("check", [["format", "--check"], ["check"]], ids=["formatted", "linted"])
def test_the_code_is_formatted_and_linted_by_ruff(check):
    """pyproject.toml's [tool.ruff]: ``ruff format`` at 110 columns, ``ruff check`` (pyflakes,
    pycodestyle)."""
    command = _tool("ruff")
    assert command, "ruff is missing: pip install -e '.[test]' installs it"
    done = subprocess.run(
        [command, *check, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (
        f"ruff {' '.join(check)} (run it to see, or fix):\n{done.stdout}{done.stderr}"
    )


def test_the_import_linter_contracts_hold(tmp_path):
    """setup.cfg's layers and forbidden contracts (docs/development.rst draws them), imports in functions
    included."""
    command = _lint_imports()
    assert command, "lint-imports is missing: pip install -e '.[test]' installs import-linter"
    done = subprocess.run(
        [command, "--config", str(ROOT / "setup.cfg"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout and "Layers:" in done.stdout


def _modules():
    """``{dotted name: path}`` of every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name, path, modules):
    """The package's modules that ``name`` imports anywhere in it (inside functions too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.add(child if child in modules else target)
    return {module for module in found if module in modules and module != name}


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle_and_only_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


def test_no_module_imports_itself_back_even_from_inside_a_function():
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


ATTRIBUTES = 12  # past this, a class is several objects
METHODS = 20  # past this too
LINES = 400  # past this, a module is several concepts


def _assigned_attributes(cls):
    """The distinct ``self.x`` a class assigns (plain, annotated and augmented; tuple targets included).

    ``self.x[i] = v`` and ``self.x.y = v`` change what ``self.x`` holds, not which attributes the object has.
    """

    def targets_of(target):
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                yield from targets_of(element)
        elif isinstance(target, ast.Starred):
            yield from targets_of(target.value)
        elif (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
        ):
            yield target.attr

    names = set()
    for node in ast.walk(cls):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            names.update(targets_of(target))
    return names


def test_attribute_counter_counts_tuple_and_augmented_assignments():
    source = (
        "class A:\n def f(self):\n  self.a, (self.b, self.c) = 1, (2, 3)\n  self.d += 1\n  self.a = 4\n"
        "  x.e = 5\n  self.f[0] = 1\n  self.g.h = 2\n  *self.i, = [3]\n"
    )
    assert _assigned_attributes(ast.parse(source).body[0]) == {"a", "b", "c", "d", "i"}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda path: str(path.relative_to(ROOT)))
def test_modules_are_small_and_classes_hold_few_attributes_and_methods(path):
    lines = path.read_text().count("\n")
    assert lines <= LINES, (
        f"{path.relative_to(ROOT)} has {lines} lines (at most {LINES}): split it by concept"
    )
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            names = _assigned_attributes(node)
            assert len(names) <= ATTRIBUTES, (
                f"{path.relative_to(ROOT)}: class {node.name} assigns {len(names)} "
                f"attributes (at most {ATTRIBUTES}): {sorted(names)}"
            )
            methods = _methods(node)
            assert len(methods) <= METHODS, (
                f"{path.relative_to(ROOT)}: class {node.name} has {len(methods)} methods (at most "
                f"{METHODS}): "
                f"{methods}"
            )


#: Python files of the repository outside the package that are libraries (test modules are not: what they
#: hold is their tests), which the package's limits apply to as well
LIBRARIES = sorted(
    path
    for folder in ("gpu", "examples", "tests", "tests/parallel", "docs", "slurm")
    for path in (ROOT / folder).glob("*.py")
    if not path.name.startswith("test_")
)


@pytest.mark.parametrize("path", LIBRARIES, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_repository_s_other_python_libraries_are_held_to_the_same_limits(path):
    test_modules_are_small_and_classes_hold_few_attributes_and_methods(path)


def test_the_limits_reach_the_gpu_check_and_the_tests_helpers():
    names = {str(path.relative_to(ROOT)) for path in LIBRARIES}
    assert {"gpu/check.py", "gpu/bench.py", "tests/conftest.py", "tests/small_net.py"} <= names


PARALLEL = PACKAGE / "parallel"
#: the modules of parallel/ above its families: the package's roll-call and what every layout holds
ABOVE_FAMILIES = {"__init__", "holding"}
TOP_LEVEL_MODULES = 15


def _contract(name):
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    section = parser[f"importlinter:contract:{name}"]
    return {
        key: set(section[key].split())
        for key in ("modules", "source_modules", "forbidden_modules")
        if key in section
    }


def test_parallel_is_a_small_core_and_families_each_a_package_that_says_what_it_is():
    modules = sorted(path.stem for path in PARALLEL.glob("*.py"))
    assert len(modules) <= TOP_LEVEL_MODULES, f"parallel/ has {len(modules)} top-level modules: {modules}"
    families = sorted(path.parent.name for path in PARALLEL.glob("*/__init__.py"))
    assert families == sorted(name.rsplit(".", 1)[1] for name in _contract("parallel-families")["modules"])
    for family in families:
        assert ast.get_docstring(ast.parse((PARALLEL / family / "__init__.py").read_text())), family


def test_the_parallel_contracts_name_every_core_module_and_every_family():
    """The core is every top-level module of parallel/ but those above the families: the contract that keeps
    families out of it names each of them (a new core module is held to it at once)."""
    core = {f"mpidist.parallel.{path.stem}" for path in PARALLEL.glob("*.py")} - {
        f"mpidist.parallel.{name}" for name in ABOVE_FAMILIES
    }
    families = _contract("parallel-families")["modules"]
    assert _contract("parallel-core") == {"source_modules": core, "forbidden_modules": families}
    assert _contract("parallel-holding") == {
        "source_modules": core | families,
        "forbidden_modules": {"mpidist.parallel.holding"},
    }


def _methods(cls):
    """The functions a class body defines (properties and class methods included, nested classes' not)."""
    return [node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_method_counter_counts_the_class_body_alone():
    source = (
        "class A:\n @property\n def p(self): pass\n @classmethod\n def c(cls): pass\n"
        " async def a(self): pass\n def f(self):\n  def inner(): pass\n class B:\n  def g(self): pass\n"
    )
    assert _methods(ast.parse(source).body[0]) == ["p", "c", "a", "f"]


#: mpi4py's buffer-based calls: the ones that hand an array to MPI
BUFFER_CALLS = {
    "Send",
    "Recv",
    "Isend",
    "Irecv",
    "Bcast",
    "Ibcast",
    "Allreduce",
    "Iallreduce",
    "Reduce",
    "Ireduce",
    "Allgather",
    "Iallgather",
    "Allgatherv",
    "Gather",
    "Gatherv",
    "Scatter",
    "Scatterv",
    "Reduce_scatter",
    "Sendrecv",
    "Alltoall",
    "Alltoallv",
    "Put",
    "Get",
    "Accumulate",
    "Get_accumulate",
    "Fetch_and_op",
    "Compare_and_swap",
    "Rput",
    "Rget",
}
#: the modules that hand arrays to MPI, and the named exceptions (docs/development.rst says why)
# the hand-written baseline: what a user writes with raw mpi4py
MPI_GATES = {
    "mpidist/runtime/comm.py",
    "mpidist/runtime/rma.py",
    "mpidist/bench/rows.py",
}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda path: str(path.relative_to(ROOT)))
def test_arrays_reach_mpi_only_through_comm_and_rma(path):
    if str(path.relative_to(ROOT)) in MPI_GATES:
        return
    calls = [
        f"line {node.lineno}: .{node.func.attr}(...)"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in BUFFER_CALLS
    ]
    assert not calls, (
        f"{path.relative_to(ROOT)} hands arrays to MPI itself (use mpidist.runtime.comm): {calls}"
    )


#: where the layout may be asked what it is: the mesh, and the tensor modules (whose business the parts are)
LAYOUT_OWNERS = {
    "mpidist/parallel/mesh.py",
    "mpidist/parallel/parts.py",
    "mpidist/parallel/tensor/part.py",
    "mpidist/nn/tensor.py",
}


def _layout_probes(tree):
    """Lines that ask what kind of exchange an object is (``isinstance(x, ...Exchange)``) or whether a tensor
    part exists (``x.tensor is None``, ``if x.tensor``): layout by flags, where the mesh and the exchange's
    own methods should answer."""

    def names(node):
        return (
            [e for n in node.elts for e in names(n)]
            if isinstance(node, ast.Tuple)
            else [node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")]
        )

    def is_tensor(node):
        return isinstance(node, ast.Attribute) and node.attr == "tensor"

    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "isinstance"
            and len(node.args) == 2
            and any(name.endswith("Exchange") for name in names(node.args[1]))
        ):
            found.append(f"line {node.lineno}: isinstance on an exchange")
        if (
            isinstance(node, ast.Compare)
            and is_tensor(node.left)
            and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
        ):
            found.append(f"line {node.lineno}: a test of .tensor against None")
        if isinstance(node, (ast.If, ast.IfExp, ast.While)) and (
            is_tensor(node.test) or (isinstance(node.test, ast.UnaryOp) and is_tensor(node.test.operand))
        ):
            found.append(f"line {node.lineno}: a branch on .tensor")
    return sorted(found, key=lambda probe: int(probe.split()[1].rstrip(":")))


def test_the_layout_probe_finder_finds_each_kind_and_nothing_else():
    source = (
        "if isinstance(e, (int, NodeModelExchange)): pass\nif self.tensor is not None: pass\n"
        "x = 1 if not strategy.tensor else 2\nif self.tensor: pass\nif settings.tensor > 1: pass\n"
        "isinstance(e, Exchanger)\nself.tensor.squares(g)\n"
    )
    assert [line.split(":")[0] for line in _layout_probes(ast.parse(source))] == [
        "line 1",
        "line 2",
        "line 3",
        "line 4",
    ]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda path: str(path.relative_to(ROOT)))
def test_the_layout_enters_through_the_mesh_not_through_flags(path):
    if str(path.relative_to(ROOT)) in LAYOUT_OWNERS:
        return
    probes = _layout_probes(ast.parse(path.read_text()))
    assert not probes, (
        f"{path.relative_to(ROOT)} asks what the layout is (ask the mesh, or give the exchange or "
        f"the tensor part a method): {probes}"
    )
