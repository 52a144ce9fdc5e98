"""The import graph keeps the layering DEVELOPERS.md states: no cycles (lazy imports inside
functions count), kernels/ on torch and triton only, sala/ free of Ray, MLflow and HTTP, serve/
and registry/ independent of the pipelines' entry points. Read from the source with `ast`, so a
cycle hidden behind a function-level import is seen as the cycle it is."""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sala", "kernels", "registry", "serve", "pipelines")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """Every module `name` imports, anywhere in its body, as dotted names (first-party ones
    resolved to the module itself: `from a.b import c` is a.b.c when that is a module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return out


def with_parents(name: str) -> set[str]:
    """`name` and the packages Python runs first to import it: importing a.b.c runs a/__init__
    and a/b/__init__, whose own imports can close a cycle that a.b.c alone does not."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


GRAPH = {m: {p for i in imports_of(m) for p in with_parents(i) if p in MODULES and p != m and not m.startswith(p + ".")}
         for m in MODULES}


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_lazy_import_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert first_cycle(graph) == ["a", "b", "c", "a"]
    assert first_cycle({"a": {"b"}, "b": set()}) is None
    assert "sala.quant.load" in GRAPH["sala.checkpoint"]  # function-level imports are in the graph too
    # Importing a submodule runs its packages' __init__ first: the edge is there too.
    assert {"sala.engine", "sala.engine.stats"} <= GRAPH["sala.engine.engine"] | {"sala.engine"}
    assert "sala.engine" in GRAPH["serve.app"]


def test_no_import_cycles():
    cycle = first_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def third_party(name: str) -> set[str]:
    top = {i.split(".")[0] for i in imports_of(name)}
    return {t for t in top if t not in sys.stdlib_module_names and t not in PACKAGES and t != "__future__"}


@pytest.mark.parametrize("layer,forbidden", [
    ("kernels", {"sala", "registry", "serve", "pipelines"}),
    ("sala", {"ray", "mlflow", "fastapi", "starlette", "uvicorn", "httpx", "requests", "registry", "serve", "pipelines"}),
    ("registry", {"ray", "serve", "pipelines"}),
    ("serve", {"pipelines"}),
])
def test_layers_import_only_what_they_may(layer, forbidden):
    bad = {m: sorted({i.split(".")[0] for i in imports_of(m)} & forbidden)
           for m in MODULES if m.split(".")[0] == layer}
    assert not {m: b for m, b in bad.items() if b}


def test_kernels_need_only_torch_and_triton():
    extra = {m: sorted(third_party(m) - {"torch", "triton"}) for m in MODULES if m.startswith("kernels")}
    assert not {m: e for m, e in extra.items() if e}


def test_the_nvfp4_format_has_one_definition():
    """The E2M1 table and the FP4 unpack/decode live in kernels/nvfp4_gemm.py alone; everyone else imports them."""
    names = {"E2M1_VALUES", "unpack_fp4", "decode_e2m1", "dequantize_fp4"}
    where: dict[str, list[str]] = {}
    for m, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            defined = ({t.id for t in node.targets if isinstance(t, ast.Name)} if isinstance(node, ast.Assign)
                       else {node.name} if isinstance(node, ast.FunctionDef) else set())
            for n in defined & names:
                where.setdefault(n, []).append(m)
    assert where == {n: ["kernels.nvfp4_gemm"] for n in names}
