"""engine/_native.pyi against the built engine._native, so the stub cannot drift from the bindings.

The stub is read with ast (nothing of it is imported) and compared with the
live module both ways: every public name of the module and every attribute a
binding gives a class (methods, properties, static methods, the dunders bound
with .def) is in the stub, as the same kind of thing, with the parameter names
and defaults of pybind11's signature; and the stub has nothing the module lacks.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine import _native

STUB = Path(_native.__file__).parent / "_native.pyi"
if not STUB.exists():  # an editable install keeps the extension out of the source tree
    STUB = Path(__file__).resolve().parents[2] / "engine" / "_native.pyi"

ADVICE = (
    "engine/_native.pyi no longer matches engine._native as built from native/bindings/*.cpp. "
    "Whoever changes a binding updates the stub in the same commit (for instance replacing "
    "Engine.set_tracing/drain_trace with a TraceRecorder and Engine.add_observer/remove_observer, "
    "or removing Engine.bench_noop_graph): add, remove or re-sign the names below."
)


# --- the stub ------------------------------------------------------------------------------------


@dataclass
class Sig:
    params: list[tuple[str, str | None, bool]]  # (name, default source or None, positional-only)
    returns: str


@dataclass
class Member:
    kind: str  # "method", "property", "staticmethod"
    sigs: list[Sig] = field(default_factory=list)  # one per overload


@dataclass
class StubClass:
    bases: list[str]
    members: dict[str, Member]


def _sig(fn: ast.FunctionDef, skip_self: bool) -> Sig:
    a = fn.args
    assert not (a.vararg or a.kwarg or a.kwonlyargs), f"{fn.name}: the bindings take no *args, **kwargs or keyword-only"
    positional = [(p, True) for p in a.posonlyargs] + [(p, False) for p in a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [(p.arg, None if d is None else ast.unparse(d), posonly) for (p, posonly), d in zip(positional, defaults)]
    assert fn.returns is not None, f"{fn.name}: no return type"
    return Sig(params[1:] if skip_self else params, ast.unparse(fn.returns))


def _decorators(fn: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d) for d in fn.decorator_list}


def parse_stub(path: Path) -> tuple[dict[str, str], dict[str, Sig], dict[str, StubClass]]:
    """(constants: name -> annotation, functions, classes) of the stub's public names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    constants: dict[str, str] = {}
    functions: dict[str, Sig] = {}
    classes: dict[str, StubClass] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if not node.target.id.startswith("_"):
                constants[node.target.id] = ast.unparse(node.annotation)
        elif isinstance(node, ast.FunctionDef):
            if not node.name.startswith("_"):
                functions[node.name] = _sig(node, skip_self=False)
        elif isinstance(node, ast.ClassDef):
            members: dict[str, Member] = {}
            for item in node.body:
                if not isinstance(item, ast.FunctionDef):
                    continue
                decorators = _decorators(item) - {"overload"}
                kind = "property" if "property" in decorators else "staticmethod" if "staticmethod" in decorators else "method"
                member = members.setdefault(item.name, Member(kind))
                assert member.kind == kind, f"{node.name}.{item.name} is declared as both {member.kind} and {kind}"
                member.sigs.append(_sig(item, skip_self=kind != "staticmethod"))
            classes[node.name] = StubClass([ast.unparse(b) for b in node.bases], members)
    return constants, functions, classes


# --- the module ----------------------------------------------------------------------------------


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


_SIGNATURE = re.compile(r"^(?:\d+\. )?(\w*)\((.*)\) -> (.*)$", re.M)


def live_sigs(name: str, fn: object, skip_self: bool) -> list[Sig]:
    """The signatures pybind11 writes at the head of a bound function's docstring (one per overload)."""
    doc = getattr(fn, "__doc__", None) or ""
    sigs = []
    for match in _SIGNATURE.finditer(doc):
        if match.group(1) != name or match.group(2) == "*args, **kwargs":
            continue
        params = []
        for part in _split_top_level(match.group(2)):
            pname, _, rest = part.partition(":")
            default = rest.split(" = ", 1)[1].strip() if " = " in rest else None
            params.append((pname.strip(), default, bool(re.fullmatch(r"arg\d+", pname.strip()))))
        sigs.append(Sig(params[1:] if skip_self else params, match.group(3).strip().replace("engine._native.", "")))
    assert sigs, f"no pybind11 signature in the docstring of {name}: {doc[:200]!r}"
    return sigs


def live_members(cls: type) -> dict[str, tuple[str, object]]:
    """name -> (kind, object) of what the bindings define on cls itself."""
    out = {}
    for name, value in vars(cls).items():
        bound = type(value).__name__ == "instancemethod"  # pybind11's own method type
        if isinstance(value, property):
            kind = "property"
        elif isinstance(value, staticmethod):
            kind = "staticmethod"
        elif bound:
            kind = "method"
        else:
            continue  # __doc__, __module__, the default __init__ of a class without constructor
        if name.startswith("__") and name.endswith("__") and (bound or kind == "staticmethod"):
            out[name] = (kind, value)
        elif not name.startswith("_"):
            out[name] = (kind, value)
    return out


def public_names() -> set[str]:
    return {n for n in dir(_native) if not n.startswith("_")}


# --- the comparisons -----------------------------------------------------------------------------


def _report(problems: list[str]) -> None:
    assert not problems, ADVICE + "\n" + "\n".join(problems)


def _stubbed_classes(classes: dict[str, StubClass], exceptions: bool) -> list[tuple[str, type]]:
    """(name, live class) of the classes both sides have: the exceptions, or the others."""
    both = [(n, getattr(_native, n)) for n in sorted(public_names() & set(classes))]
    return [(n, c) for n, c in both if inspect.isclass(c) and issubclass(c, BaseException) == exceptions]


@pytest.fixture(scope="module")
def stub():
    return parse_stub(STUB)


def _sig_problems(where: str, live: list[Sig], stubbed: list[Sig]) -> list[str]:
    if len(live) != len(stubbed):
        return [f"{where}: {len(live)} signature(s) bound, {len(stubbed)} in the stub"]
    problems = []
    for i, (lv, st) in enumerate(zip(live, stubbed)):
        tag = f"{where} (overload {i + 1})" if len(live) > 1 else where
        if len(lv.params) != len(st.params):
            problems.append(f"{tag}: bound ({', '.join(p[0] for p in lv.params)}), "
                            f"stub ({', '.join(p[0] for p in st.params)})")
            continue
        for (lname, ldefault, unnamed), (sname, sdefault, posonly) in zip(lv.params, st.params):
            if unnamed:  # pybind11's arg0: the stub may name it, but only positionally
                if not posonly:
                    problems.append(f"{tag}: {lname} is unnamed in the binding; make '{sname}' positional-only (/)")
            elif lname != sname or posonly:
                problems.append(f"{tag}: parameter '{lname}' is '{sname}'{' (positional-only)' if posonly else ''} in the stub")
            if ldefault != sdefault:
                problems.append(f"{tag}: {lname}'s default is {ldefault} bound, {sdefault} in the stub")
        if not _returns_agree(lv.returns, st.returns):
            problems.append(f"{tag}: returns {lv.returns} bound, {st.returns} in the stub")
    return problems


def _returns_agree(live: str, stubbed: str) -> bool:
    """pybind11 names the type of what a binding returns unless the binding builds a py::object
    (a dict, a list of tuples, a tuple or None): there the stub says more, and only it can."""
    if live in ("object", "dict", "list") or "object" in live:
        return True
    # A shared_ptr return may be null (SlotTable.accessor): the stub may add None.
    return stubbed in (live, f"{live} | None")


def test_module_names_match(stub):
    constants, functions, classes = stub
    stubbed = set(constants) | set(functions) | set(classes)
    live = public_names()
    problems = [f"in engine._native, not in the stub: {n}" for n in sorted(live - stubbed)]
    problems += [f"in the stub, not in engine._native: {n}" for n in sorted(stubbed - live)]
    _report(problems)


def test_kinds_and_signatures_match(stub):
    constants, functions, classes = stub
    problems = []
    for name in sorted(public_names()):
        obj = getattr(_native, name)
        if name in constants:
            if not isinstance(obj, int) or constants[name] != "Final[int]":
                problems.append(f"{name}: a {type(obj).__name__} in the module, {constants[name]} in the stub")
        elif name in functions:
            if not callable(obj) or inspect.isclass(obj):
                problems.append(f"{name}: a function in the stub, a {type(obj).__name__} in the module")
            else:
                problems += _sig_problems(name, live_sigs(name, obj, skip_self=False), [functions[name]])
        elif name in classes:
            if not inspect.isclass(obj):
                problems.append(f"{name}: a class in the stub, a {type(obj).__name__} in the module")
        # a name in neither is test_module_names_match's
    _report(problems)


def test_exception_bases_match(stub):
    _, _, classes = stub
    problems = []
    for name, cls in _stubbed_classes(classes, exceptions=True):
        live_bases = [b.__name__ for b in cls.__bases__]
        if live_bases != classes[name].bases:
            problems.append(f"{name}: bases {live_bases} bound, {classes[name].bases} in the stub")
    _report(problems)


def test_class_members_match(stub):
    _, _, classes = stub
    problems = []
    for name, cls in _stubbed_classes(classes, exceptions=False):
        live = live_members(cls)
        stubbed = classes[name].members
        problems += [f"{name}.{m}: bound, not in the stub" for m in sorted(set(live) - set(stubbed))]
        problems += [f"{name}.{m}: in the stub, not bound" for m in sorted(set(stubbed) - set(live))]
        for m in sorted(set(live) & set(stubbed)):
            kind, value = live[m]
            if kind != stubbed[m].kind:
                problems.append(f"{name}.{m}: a {kind} bound, a {stubbed[m].kind} in the stub")
            elif kind == "property":  # pybind11 signs a getter "(arg0: Cls) -> T"
                problems += _sig_problems(f"{name}.{m}", live_sigs("", value.fget, skip_self=True), stubbed[m].sigs)
            else:
                fn = value.__func__ if isinstance(value, staticmethod) else value
                problems += _sig_problems(f"{name}.{m}", live_sigs(m, fn, skip_self=kind == "method"),
                                          stubbed[m].sigs)
    _report(problems)


def test_the_comparison_sees_drift(tmp_path):
    """The parser finds what a stale stub gets wrong: a missing method, a renamed parameter, a lost default."""
    text = STUB.read_text()
    stale = text.replace("    def stop_admitting(self) -> None: ...\n", "", 1)
    stale = stale.replace("def free(self, buf: Buffer)", "def free(self, buffer: Buffer)", 1)
    stale = stale.replace("def begin_run(self, notify: bool = False)", "def begin_run(self, notify: bool)", 1)
    assert stale.count("\n") == text.count("\n") - 1
    path = tmp_path / "_native.pyi"
    path.write_text(stale)
    _, _, classes = parse_stub(path)
    assert "stop_admitting" not in classes["Engine"].members
    free = live_sigs("free", _native.Device.free, skip_self=True)
    assert any("'buf' is 'buffer'" in p for p in _sig_problems("Device.free", free, classes["Device"].members["free"].sigs))
    begin = live_sigs("begin_run", _native.Engine.begin_run, skip_self=True)
    assert any("default is False bound, None" in p
               for p in _sig_problems("Engine.begin_run", begin, classes["Engine"].members["begin_run"].sigs))
