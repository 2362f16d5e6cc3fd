"""Dependencies point one way, down the layers of the house (README, "How it fits together"):

    files, extras  <-  numerics  <-  kernels  <-  nn  <-  optim  <-  hf  <-  train  <-  release  <-  hf_fp4, cli

A module imports only modules of its own layer or below, deferred imports included, and the imports among all
modules form no cycle -- so no deferred import hides one."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [{"files", "extras"}, {"numerics"}, {"kernels"}, {"nn"}, {"optim"}, {"hf"}, {"train"}, {"release"},
          {"__init__", "__main__", "cli"}]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def module_files() -> dict[str, Path]:
    """'hf_fp4.nn.linear' -> path, for the package and the kernels folder shipped as hf_fp4.kernels."""
    out = {}
    for path in (ROOT / "hf_fp4").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (ROOT / "kernels" / "src").glob("*.py"):
        out["hf_fp4.kernels" + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The hf_fp4 modules `name` imports (absolute or relative, deferred ones included)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import module` names a module
                full = f"{target}.{alias.name}"
                found.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {t for t in found if t in known and t != name}


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


GRAPH = {name: imports(name, path, set(module_files())) for name, path in module_files().items()}


def test_every_module_belongs_to_a_layer():
    assert not [n for n in GRAPH if layer(n) not in RANK], "a new top-level module needs a place in LAYERS"


def test_modules_import_only_their_layer_or_below():
    upward = [f"{n} -> {t}" for n, targets in GRAPH.items() for t in targets if RANK[layer(t)] > RANK[layer(n)]]
    assert not upward, "imports that point up the layers: " + "; ".join(sorted(upward))


def test_the_imports_form_no_cycle():
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for t in sorted(GRAPH[n]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t, path + [t])
        state[n] = 2

    for n in sorted(GRAPH):
        if n not in state:
            visit(n, [n])


def test_the_reference_imports_no_kernel():
    """The spec stands alone: hf_fp4.numerics imports nothing but itself and the base helpers."""
    for n, targets in GRAPH.items():
        if layer(n) == "numerics":
            assert all(layer(t) in {"numerics", "files", "extras"} for t in targets), (n, targets)


def test_the_wheel_ships_every_subpackage():
    """pyproject.toml lists the packages by hand (kernels/src/ maps to hf_fp4.kernels): a new subpackage missing
    there would import in an editable install and be absent from the wheel the GPU machine installs."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hf_fp4").rglob("__init__.py")}
    assert present | {"hf_fp4.kernels"} == listed


def test_a_checkout_on_sys_path_never_shadows_hugging_faces_kernels_package(tmp_path):
    """`python -m hf_fp4` / `python -c` from the repository root put the checkout first on sys.path; the card's
    kernels/ folder must not then be what `import kernels` finds (transformers >= 5.25 installs Hugging Face's
    kernel hub and imports names from it while loading; a regular package here broke every model load).  Checked
    with a stand-in kernel hub further down sys.path (and no site-packages), whichever transformers is installed."""
    import subprocess
    import sys

    hub = tmp_path / "site" / "kernels"
    hub.mkdir(parents=True)
    (hub / "__init__.py").write_text("CUDAProperties = 'the hub'\n")
    probe = ("import sys; sys.path.append(sys.argv[1]); from kernels import CUDAProperties; print(CUDAProperties)")
    done = subprocess.run([sys.executable, "-S", "-c", probe, str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout.strip() == "the hub", done.stderr
