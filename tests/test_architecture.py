"""The package structure the design promises: data flows one way (data → extract → train → serve → launch), no
module imports a later stage, and there are no import cycles between modules. Read from the source (every
import statement, also those inside functions), so nothing is imported to check it."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("data", "extract", "train", "serve", "launch")  # each may import only itself and earlier ones


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
    """The project modules a file imports (resolved to modules, not names inside them)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m.split(".")[0] in STAGES}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for stage in STAGES for p in (ROOT / stage).rglob("*.py")}
    return {name: {m for m in project_imports(path) if m in files and m != name} for name, path in files.items()}


def test_no_stage_imports_a_later_stage():
    order = {s: i for i, s in enumerate(STAGES)}
    wrong = sorted(f"{a} imports {b}" for a, deps in import_graph().items() for b in deps
                   if order[b.split(".")[0]] > order[a.split(".")[0]])
    assert wrong == []


def test_no_import_cycles():
    graph, cycles = import_graph(), []
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" → ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_checker_sees_a_later_stage_and_a_cycle(tmp_path, monkeypatch):
    """The checks above can fail: a planted backward import and a planted cycle are found."""
    for stage in STAGES:
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "__init__.py").write_text("")
    (tmp_path / "data" / "a.py").write_text("from serve.b import x\nfrom .c import y\n")
    (tmp_path / "serve" / "b.py").write_text("x = 1\n")
    (tmp_path / "data" / "c.py").write_text("def f():\n    from data import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph()
    assert graph["data.a"] == {"serve.b", "data.c"}
    assert graph["data.c"] == {"data", "data.a"}
    with pytest.raises(AssertionError, match="data.a imports serve.b"):
        test_no_stage_imports_a_later_stage()
    with pytest.raises(AssertionError, match="data.a → data.c → data.a"):
        test_no_import_cycles()


def test_the_configs_choices_are_the_extension_tables():
    """A drafter architecture or an extraction backend is a module plus a table entry; the config offers exactly
    the table's names (plus `auto` for backends)."""
    from typing import get_args

    from data.config import DrafterConfig, ExtractConfig
    from extract import BACKENDS
    from train.drafters import DRAFTERS
    assert set(get_args(DrafterConfig.model_fields["arch"].annotation)) == set(DRAFTERS)
    assert set(get_args(ExtractConfig.model_fields["backend"].annotation)) == set(BACKENDS) | {"auto"}
    assert all(arch.name == name for name, arch in DRAFTERS.items())


def test_a_drafter_config_naming_no_class_is_the_llama_drafter_and_an_unknown_class_is_refused():
    from transformers import LlamaConfig

    from train.drafters import arch_of
    assert arch_of(LlamaConfig(hidden_size=16, num_attention_heads=2)).name == "llama"  # as before the table: the GPU TTT tests build these
    assert arch_of(LlamaConfig(architectures=["Eagle3DeepseekV2ForCausalLM"])).name == "mla"
    with pytest.raises(ValueError, match="'MedusaModel': not an EAGLE-3 drafter class Eyrie knows"):
        arch_of(LlamaConfig(architectures=["MedusaModel"]))
