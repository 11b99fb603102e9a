"""PTX templates: declare, render, validate (STYLE.md, "A PTX kernel").

A template `kernels_ptx/<name>.ptx` is literal `.target sm_20` PTX plus three renderer forms:

* `${expr}`: a constant. `expr` uses the template's parameters, `@repeat` indices, integers,
  strings, `+ - * // % << >> & |`, comparisons, `and`/`or`/`not`, and `f32(x)`, which writes x
  as an exact hex bit pattern (`0f3F800000`), the only way a float enters PTX here.
* `@repeat NAME COUNT` ... `@end`: the block emitted COUNT times with NAME = 0..COUNT-1 (nests).
  This is how unrolled code is written once.
* `@if expr` ... [`@else` ...] `@end`: a block kept or dropped by a parameter.

Beside it, `kernels_ptx/<name>.py` (plain data: kernels_ptx imports nothing) declares
`PARAMS = {"NAME": (type, (allowed values...)), ...}`. Every combination of allowed values is a
variant the engine may launch, so `kernels check` assembles all of them. The renderer checks the
values, substitutes strictly (an unknown name or a leftover `${` is an error), writes the
`.version`/`.target` header, and requires every `.entry` to declare `.maxntid` (its block size,
so ptxas budgets registers for it: STYLE.md) and `.maxnreg` of at most 63, Fermi's limit. The cap
binds on every GPU, so a newer card runs the register allocation a Fermi could (ptxas spills
rather than exceed it; `kernels check` reports the spills).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import itertools
import operator
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from fermijit import FermijitError

# PTX ISA 3.0 is what the Fermi-era drivers JIT, and what the device notes saw load on the H200.
HEADER = ".version 3.0\n.target sm_20\n.address_size 64\n"
FERMI_MAX_THREADS = 1024
FERMI_MAX_SHARED_BYTES = 48 * 1024
FERMI_MAX_REGISTERS = 63

_TEMPLATE_DIR = Path(importlib.import_module("fermijit.kernels_ptx").__file__).resolve().parent
_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_DIRECTIVE = re.compile(r"^\s*@(repeat|if|else|end)\b(.*)$")
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)\s+(\w+)")
_MAXNTID = re.compile(r"\.maxntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")
_MAXNREG = re.compile(r"\.maxnreg\s+(\d+)")


@dataclass(frozen=True)
class Entry:
    """One `.entry` of a rendered module: its PTX parameter types in order and its block limit."""

    name: str
    param_types: tuple[str, ...]  # PTX types, e.g. ("u64", "u64", "u32", "f32")
    param_names: tuple[str, ...]
    max_threads: int  # product of .maxntid


@dataclass(frozen=True)
class Rendered:
    """A rendered template: the PTX text and what the loader and `kernels check` need to know."""

    template: str
    params: tuple[tuple[str, object], ...]  # sorted (name, value)
    text: str
    entries: dict[str, Entry]

    @property
    def label(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.template}({args})"


def f32(x: float) -> str:
    """A float as PTX's exact hex immediate (`0f3F800000` is 1.0)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", float(x)))[0]


def template_names() -> list[str]:
    """Every template that has both its `.ptx` and its parameter declaration."""
    return sorted(p.stem for p in _TEMPLATE_DIR.glob("*.ptx") if p.with_suffix(".py").exists())


def declared_params(name: str) -> dict[str, tuple[type, tuple]]:
    if name not in template_names():
        raise FermijitError(f"no PTX template {name!r} in {_TEMPLATE_DIR}")
    params = importlib.import_module(f"fermijit.kernels_ptx.{name}").PARAMS
    for key, (kind, allowed) in params.items():
        if kind not in (int, str) or not allowed or not all(type(v) is kind for v in allowed):
            raise FermijitError(f"kernels_ptx/{name}.py: {key} must be (int|str, (values...))")
    return params


def variants(name: str) -> list[dict[str, object]]:
    """Every parameter combination of `name` (the variants the engine may launch)."""
    params = declared_params(name)
    keys = sorted(params)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(params[k][1] for k in keys))]


def render(name: str, **params) -> Rendered:
    """Render template `name` with `params`; cached per process (an edit shows on the next run)."""
    return _render(name, tuple(sorted(params.items())))


@functools.lru_cache(maxsize=None)
def _render(name: str, params: tuple[tuple[str, object], ...]) -> Rendered:
    declared = declared_params(name)  # first: it names a missing template
    source = (_TEMPLATE_DIR / f"{name}.ptx").read_text()
    label = _checked(name, source, declared, dict(params))
    stored = _stored_path(name, source, params)
    text = _read_stored(stored)
    if text is None:
        text = _text(name, source, dict(params), label)
        _store(stored, text)
    return Rendered(name, params, text, _entries(text, label))


# Rendered text is kept across runs, a file a variant in the user's cache folder (fermijit's
# private one, as Numba's fallback): the GPU's first pass at a server's start renders the kernels
# it meets on a thread beside the CPU kernels' load, both holding the GIL (issue 28 item 4), and
# all 61 variants took 0.29 s to render on a Zen 3 core. The file's name digests what the text
# depends on (this renderer's source, the template, the parameters), its first line digests the
# text itself (a torn or altered file is rendered again). FERMIJIT_PTX_CACHE=0: render every run.
STORE_ENV = "FERMIJIT_PTX_CACHE"
_STAMP = "// fermijit rendered "


@functools.lru_cache(maxsize=1)
def _store_dir() -> Path | None:
    import os

    from fermijit import private_cache_dir, private_dir

    if os.environ.get(STORE_ENV, "1") == "0":
        return None
    folder = private_cache_dir()
    return folder / "ptx" if folder is not None and private_dir(folder / "ptx") else None


@functools.lru_cache(maxsize=1)
def _renderer_digest() -> bytes:
    return hashlib.sha256(Path(__file__).read_bytes()).digest()


def _stored_path(name: str, source: str, params: tuple) -> Path | None:
    folder = _store_dir()
    if folder is None:
        return None
    key = hashlib.sha256(_renderer_digest() + source.encode() + repr(params).encode())
    return folder / f"{name}-{key.hexdigest()[:32]}.ptx"


def _read_stored(path: Path | None) -> str | None:
    """The rendered text stored at `path`, None where there is none or it fails its digest."""
    if path is None:
        return None
    try:
        stamp, _, text = path.read_text().partition("\n")
    except (OSError, UnicodeDecodeError):
        return None
    return text if stamp == _STAMP + hashlib.sha256(text.encode()).hexdigest() else None


def _store(path: Path | None, text: str) -> None:
    """`text` at `path` whole or not at all (a temporary file renamed); failures ignored (the
    store saves time, nothing else)."""
    import os
    import tempfile

    if path is None:
        return
    temporary = None
    try:
        fd, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(_STAMP + hashlib.sha256(text.encode()).hexdigest() + "\n" + text)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)


def _checked(name: str, source: str, declared: dict[str, tuple[type, tuple]],
             given: dict[str, object]) -> str:
    """The variant's label, once `given` and `source` pass the renderer's checks (a
    FermijitError otherwise)."""
    params = tuple(sorted(given.items()))
    label = f"{name}({', '.join(f'{k}={v}' for k, v in params)})"
    if set(given) != set(declared):
        missing, extra = set(declared) - set(given), set(given) - set(declared)
        raise FermijitError(f"{label}: missing parameters {sorted(missing)}, "
                            f"unknown parameters {sorted(extra)}")
    for key, value in given.items():
        kind, allowed = declared[key]
        if type(value) is not kind or value not in allowed:
            raise FermijitError(f"{label}: {key}={value!r} not in {allowed}")
    bad = next((i for i, line in enumerate(source.splitlines(), 1) if not line.isascii()), None)
    if bad is not None:
        raise FermijitError(f"kernels_ptx/{name}.ptx line {bad}: ptxas accepts ASCII only")
    if re.search(r"^\s*\.(version|target|address_size)\b", source, re.M):
        raise FermijitError(f"kernels_ptx/{name}.ptx: the renderer writes .version/.target")
    return label


def render_source(name: str, source: str, declared: dict[str, tuple[type, tuple]],
                  given: dict[str, object]) -> Rendered:
    """Render template text `source` (what `render` does once it has read the file)."""
    label = _checked(name, source, declared, given)
    text = _text(name, source, given, label)
    return Rendered(name, tuple(sorted(given.items())), text, _entries(text, label))


def _text(name: str, source: str, given: dict[str, object], label: str) -> str:
    """The PTX of checked template text `source` with parameters `given`."""
    try:
        body = _expand(source.splitlines(), given)
    except _TemplateError as e:
        raise FermijitError(f"kernels_ptx/{name}.ptx: {e} (rendering {label})") from None
    return HEADER + "\n".join(body) + "\n"


class _TemplateError(Exception):
    pass


def _expand(lines: list[str], env: dict[str, object]) -> list[str]:
    """Expand @repeat/@if blocks and ${...} placeholders; `lines` is one nesting level."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i])
        if m is None:
            out.append(_substitute(lines[i], env, i))
            i += 1
            continue
        kind, rest = m.group(1), m.group(2).strip()
        if kind in ("else", "end"):
            raise _TemplateError(f"@{kind} without an open block (template line {i + 1})")
        body, alt, i = _block(lines, i)
        if kind == "repeat":
            parts = rest.split(None, 1)
            if len(parts) != 2 or not parts[0].isidentifier() or alt is not None:
                raise _TemplateError(f"bad '@repeat {rest}': use '@repeat NAME COUNT'")
            var, count = parts[0], _evaluate(parts[1], env)
            if var in env:
                raise _TemplateError(f"@repeat {var} shadows a parameter")
            if type(count) is not int or count < 0:
                raise _TemplateError(f"@repeat count {parts[1]!r} = {count!r}")
            for k in range(count):
                out.extend(_expand(body, {**env, var: k}))
        else:
            out.extend(_expand(body if _evaluate(rest, env) else (alt or []), env))
    return out


def _block(lines: list[str], start: int) -> tuple[list[str], list[str] | None, int]:
    """The body (and @else part) of the block opened at `start`; returns the index after @end."""
    depth, body, alt = 0, [], None
    current = body
    for i in range(start + 1, len(lines)):
        m = _DIRECTIVE.match(lines[i])
        kind = m.group(1) if m else None
        if kind in ("repeat", "if"):
            depth += 1
        elif kind == "end":
            if depth == 0:
                return body, alt, i + 1
            depth -= 1
        elif kind == "else" and depth == 0:
            if alt is not None:
                raise _TemplateError(f"two @else in one block (template line {i + 1})")
            alt = current = []
            continue
        current.append(lines[i])
    raise _TemplateError(f"block opened at template line {start + 1} has no @end")


def _substitute(line: str, env: dict[str, object], index: int) -> str:
    pieces = _pieces(line)
    if len(pieces) == 1:
        result = line
    else:
        out = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                out.append(piece)
            else:
                v = _evaluate(piece, env)
                out.append(str(int(v)) if isinstance(v, bool) else str(v))
        result = "".join(out)
    if "${" in result:
        raise _TemplateError(f"unclosed placeholder: {line.strip()!r}")
    return result


@functools.lru_cache(maxsize=None)
def _pieces(line: str) -> list[str]:
    """A template line split once: text, placeholder expression, text, ... (odd indices)."""
    return _PLACEHOLDER.split(line)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Div: operator.truediv,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift,
           ast.BitAnd: operator.and_, ast.BitOr: operator.or_}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
            ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}


def _evaluate(expr: str, env: dict[str, object]):
    """A tiny, closed expression language: no attribute access, no calls except f32."""
    value = _compiled(expr)(env)
    if isinstance(value, float):
        raise _TemplateError(f"${{{expr}}} is a float: write f32(...) for a float immediate")
    return value


@functools.lru_cache(maxsize=None)
def _compiled(expr: str):
    """`expr` parsed once into a function of the environment: a full-size model's kernels
    evaluate ~100k placeholders, and parsing each anew was 60 % of rendering them (the GPU
    start's 2-token pass renders its kernels on a thread beside the CPU's warm-up, holding the
    GIL). Every node is evaluated (no short circuits), as the template's checks expect."""
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        raise _TemplateError(f"cannot parse ${{{expr}}}") from None

    def made(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
            constant = node.value
            return lambda env: constant
        if isinstance(node, ast.Name):
            name = node.id

            def look_up(env):
                if name not in env:
                    raise _TemplateError(f"unknown name {name!r} in ${{{expr}}}")
                return env[name]
            return look_up
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            op, left, right = _BINARY[type(node.op)], made(node.left), made(node.right)
            return lambda env: op(left(env), right(env))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            operand = made(node.operand)
            return lambda env: -operand(env)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            operand = made(node.operand)
            return lambda env: not operand(env)
        if isinstance(node, ast.BoolOp):
            values, combine = [made(v) for v in node.values], (
                all if isinstance(node.op, ast.And) else any)
            return lambda env: combine([v(env) for v in values])
        if (isinstance(node, ast.Compare) and len(node.ops) == 1
                and type(node.ops[0]) in _COMPARE):
            op, left, right = (_COMPARE[type(node.ops[0])], made(node.left),
                               made(node.comparators[0]))
            return lambda env: op(left(env), right(env))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "f32" and len(node.args) == 1 and not node.keywords):
            argument = made(node.args[0])
            return lambda env: f32(argument(env))
        raise _TemplateError(f"unsupported expression ${{{expr}}}")

    return made(tree)


def _entries(text: str, label: str) -> dict[str, Entry]:
    entries = {}
    for m in _ENTRY.finditer(text):
        params = _PARAM.findall(m.group(2))
        tail = text[m.end():text.find("{", m.end())]
        limit = _MAXNTID.search(tail)
        if limit is None:
            raise FermijitError(f"{label}: .entry {m.group(1)} declares no .maxntid")
        registers = _MAXNREG.search(tail)
        if registers is None or int(registers.group(1)) > FERMI_MAX_REGISTERS:
            raise FermijitError(f"{label}: .entry {m.group(1)} must declare .maxnreg <= "
                                f"{FERMI_MAX_REGISTERS} (Fermi's register limit)")
        threads = 1
        for g in limit.groups():
            threads *= int(g or 1)
        entries[m.group(1)] = Entry(m.group(1), tuple(t for t, _ in params),
                                    tuple(n for _, n in params), threads)
    if not entries:
        raise FermijitError(f"{label}: no .entry")
    return entries


def numbered(text: str) -> str:
    """PTX with line numbers, as printed when the driver or ptxas rejects it."""
    return "\n".join(f"{i:5d}  {line}" for i, line in enumerate(text.splitlines(), 1))
