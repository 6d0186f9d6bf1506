"""Could a GPU engine import what scripts/device/gpu-bundle.sh leaves behind? A walk of imports.

The GPU bundle leaves out packages that a text model's prompt log-probs should never import
(``LEAVE`` there), to save device calls and, for CUTLASS's CuTe DSL, a MoE warm-up of every
engine start. A wrong guess costs a whole GPU session, so this reads the carried wheels'
sources (nothing is imported or installed) and walks the imports that run when a module is
imported: module and class bodies, both branches of an ``if``, never a function body, never
``if TYPE_CHECKING``. An import inside a ``try`` that catches ImportError (or Exception) is
guarded: the walk does not follow it, and a left-behind module there is fine.

It prints how many modules the entry modules reach, every unguarded path to a left-behind
module (exit 1 if any), and every import of one inside a function, to be read: those run only
when the function does (FA4, MLA, MoE kernels...), which a walk cannot decide.

Usage: python scripts/device/gpu_leave_check.py [--wheels .gpucarry/wheels] [--leave cutlass ...]
           [--entry vllm.v1.engine.async_llm ...]
"""

from __future__ import annotations

import argparse
import ast
import sys
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Import names of what gpu-bundle.sh's LEAVE holds (its distributions' top-level modules).
LEAVE = (
    "cutlass",
    "quack",
    "tokenspeed_mla",
    "tokenspeed_triton",
    "tilelang",
    "z3",
    "cv2",
    "PyNvVideoCodec",
    "torchcodec",
)
# What runs when vLLM serves a dense text model on a GPU, in process and as the OpenAI server.
ENTRIES = (
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.warmup",
    "vllm.model_executor.warmup.kernel_warmup",
    "vllm.model_executor.warmup.minimax_m3_msa_warmup",
    "vllm.model_executor.models.llama",
    "vllm.v1.attention.backends.flash_attn",
    # Imported when the engine runs on an SM 9.0 GPU (kernel_warmup's FlashInfer autotune:
    # "flashinfer.jit: [Autotuner]" in every H200 engine log), not when vLLM is imported.
    "vllm.utils.flashinfer",
    "flashinfer",
)
GUARDS = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")


@dataclass(frozen=True)
class Import:
    """One import statement's target module, where it is, and whether it runs at import."""

    module: str
    line: int
    guarded: bool
    function: str | None  # the enclosing function, if any


def read_sources(wheels: Iterable[Path]) -> dict[str, tuple[str, bool]]:
    """Module name -> (source, is a package) for every ``.py`` file in the wheels."""
    sources: dict[str, tuple[str, bool]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if not name.endswith(".py") or ".dist-info/" in name or ".data/" in name:
                    continue
                parts = name[:-3].split("/")
                package = parts[-1] == "__init__"
                module = ".".join(parts[:-1] if package else parts)
                sources[module] = (zf.read(name).decode("utf-8", "replace"), package)
    return sources


def _catches_import_error(node: ast.Try) -> bool:
    return any(
        handler.type is None or any(g in ast.unparse(handler.type) for g in GUARDS)
        for handler in node.handlers
    )


def imports_of(module: str, source: str, package: bool) -> Iterator[Import]:
    """Every import statement of ``module``, relative ones resolved."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    base = module.split(".") if package else module.split(".")[:-1]

    def target(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join([*parts, *([node.module] if node.module else [])])

    def visit(body: list[ast.stmt], guarded: bool, function: str | None) -> Iterator[Import]:
        for node in body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield Import(alias.name, node.lineno, guarded, function)
            elif isinstance(node, ast.ImportFrom):
                mod = target(node)
                yield Import(mod, node.lineno, guarded, function)
                for alias in node.names:  # `from pkg import submodule`
                    yield Import(f"{mod}.{alias.name}", node.lineno, guarded, function)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from visit(node.body, guarded, function or node.name)
            elif isinstance(node, ast.ClassDef):
                yield from visit(node.body, guarded, function)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                yield from visit(node.orelse, guarded, function)
            elif isinstance(node, ast.Try):
                yield from visit(node.body, guarded or _catches_import_error(node), function)
                for handler in node.handlers:
                    yield from visit(handler.body, guarded, function)
                yield from visit(node.orelse, guarded, function)
                yield from visit(node.finalbody, guarded, function)
            else:
                for field in ("body", "orelse", "finalbody"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                        yield from visit(sub, guarded, function)

    yield from visit(tree.body, False, None)


@dataclass
class Report:
    reached: dict[str, tuple[str, ...]]  # module -> the import path that reached it
    # Imports of a left-behind module that run when an entry is imported: the bundle breaks.
    unguarded: list[tuple[str, Import, tuple[str, ...]]]
    # Imports inside functions of ``packages``: of a left-behind module, or of a module whose
    # own import would need one (its path). They run only if the function does: to be read.
    in_functions: list[tuple[str, Import, tuple[str, ...]]]


class _Imports:
    """Each module's imports, parsed once (the lazy check walks from hundreds of modules)."""

    def __init__(self, sources: dict[str, tuple[str, bool]]) -> None:
        self.sources = sources
        self._parsed: dict[str, list[Import]] = {}

    def __call__(self, module: str) -> list[Import]:
        if module not in self._parsed:
            self._parsed[module] = list(imports_of(module, *self.sources[module]))
        return self._parsed[module]


def _module_level(
    imports: _Imports, entries: Iterable[str], left: set[str]
) -> tuple[dict[str, tuple[str, ...]], list[tuple[str, Import, tuple[str, ...]]]]:
    sources = imports.sources
    reached: dict[str, tuple[str, ...]] = {}
    unguarded: list[tuple[str, Import, tuple[str, ...]]] = []
    todo = [(entry, (entry,)) for entry in entries]
    while todo:
        module, path = todo.pop()
        if module in reached or module not in sources:
            continue
        reached[module] = path
        parts = module.split(".")
        todo.extend((".".join(parts[:i]), path) for i in range(1, len(parts)))
        for imp in imports(module):
            if imp.function is not None or imp.guarded:
                continue
            if imp.module.split(".")[0] in left:
                unguarded.append((module, imp, path))
            elif imp.module in sources:
                todo.append((imp.module, (*path, imp.module)))
    return reached, unguarded


def walk(
    sources: dict[str, tuple[str, bool]],
    entries: Iterable[str],
    leave: Iterable[str],
    packages: Iterable[str] = ("vllm",),
) -> Report:
    """The modules ``entries`` import when imported, and what of ``leave`` they would need."""
    left = set(leave)
    imports = _Imports(sources)
    reached, unguarded = _module_level(imports, entries, left)
    listed = set(packages)
    in_functions: list[tuple[str, Import, tuple[str, ...]]] = []
    needs: dict[str, tuple[str, ...] | None] = {}  # lazily imported module -> its path to one
    for module in sorted(sources):
        if module.split(".")[0] not in listed:
            continue
        for imp in imports(module):
            if imp.function is None:
                continue
            if imp.module.split(".")[0] in left:
                in_functions.append((module, imp, ()))
            elif imp.module in sources and imp.module.split(".")[0] in listed:
                if imp.module not in needs:
                    _, hits = _module_level(imports, [imp.module], left)
                    needs[imp.module] = (*hits[0][2], hits[0][1].module) if hits else None
                path = needs[imp.module]
                if path is not None:
                    in_functions.append((module, imp, path))
    return Report(reached, unguarded, in_functions)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--wheels", type=Path, default=Path(".gpucarry/wheels"))
    ap.add_argument("--leave", nargs="+", default=list(LEAVE))
    ap.add_argument("--entry", nargs="+", default=list(ENTRIES))
    ap.add_argument("--packages", nargs="+", default=["vllm"], help="whose functions to list")
    args = ap.parse_args(argv)
    wheels = sorted(args.wheels.glob("*.whl"))
    if not wheels:
        print(f"no wheels in {args.wheels}: run scripts/device/gpu-bundle.sh", file=sys.stderr)
        return 2
    sources = read_sources(wheels)
    missing = [e for e in args.entry if e not in sources]
    if missing:
        print(f"entry modules not in the wheels: {', '.join(missing)}", file=sys.stderr)
        return 2
    report = walk(sources, args.entry, args.leave, args.packages)
    print(f"{len(wheels)} wheels, {len(sources)} modules; the entries reach {len(report.reached)}")
    # One line a statement (`from cutlass import a, b` yields an Import per name).
    said: set[tuple[str, int]] = set()
    for module, imp, path in report.unguarded:
        if (module, imp.line) not in said:
            said.add((module, imp.line))
            print(f"UNGUARDED {module}:{imp.line} imports {imp.module}, via {' > '.join(path)}")
    lines = sorted(
        {
            (module, imp.line, imp.function or "", " > ".join(path) or imp.module.split(".")[0])
            for module, imp, path in report.in_functions
        }
    )
    print(f"inside functions of {', '.join(args.packages)}, to read ({len(lines)}):")
    for module, line, function, what in lines:
        print(f"  {module}:{line} in {function}(): {what}")
    return 1 if report.unguarded else 0


if __name__ == "__main__":
    raise SystemExit(main())
