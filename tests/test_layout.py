"""Dependencies point one way: the numerics (the reference's modules and the data types the kernels share)
import nothing above them, and the kernels import only the numerics -- so no deferred import hides a cycle."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUMERICS = {"formats", "scales", "spec", "hadamard", "philox", "qtensor", "operand_plan", "quantize"}


def hf_fp4_imports(path: Path) -> set[str]:
    """The hf_fp4 modules a file imports (absolute or relative, deferred ones included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if node.level == 0 and parts[0] == "hf_fp4" and len(parts) > 1:
                found.add(parts[1])
            elif node.level == 1 and path.parent.name == "hf_fp4":
                found.add(parts[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("hf_fp4.")}
    return found


def test_kernels_import_only_the_numerics():
    for path in (ROOT / "kernels").glob("*.py"):
        above = hf_fp4_imports(path) - NUMERICS - {"quantize"}
        assert not above, f"{path.name} imports {sorted(above)} (kernels may use only {sorted(NUMERICS)})"
        assert "quantize" not in hf_fp4_imports(path), f"{path.name}: the quantizer calls the kernels, not back"


def test_numerics_import_nothing_above_them():
    for name in NUMERICS:
        above = hf_fp4_imports(ROOT / "hf_fp4" / f"{name}.py") - NUMERICS - {"kernels"}
        assert not above, f"hf_fp4/{name}.py imports {sorted(above)}"
