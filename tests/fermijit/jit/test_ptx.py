"""The PTX template renderer (fermijit/jit/ptx.py): strict, exact, and every shipped variant
renders. No GPU or ptxas needed."""

import pytest

from fermijit import FermijitError
from fermijit.jit import ptx

ENTRY = """.visible .entry k_${MODE}(.param .u64 p_out)
.maxntid ${THREADS}, 1, 1
.maxnreg 63
{
BODY
}
"""
DECLARED = {"MODE": (str, ("a", "b")), "THREADS": (int, (64, 128))}


def render(body: str, **params):
    params = {"MODE": "a", "THREADS": 64, **params}
    return ptx.render_source("test", ENTRY.replace("BODY", body), DECLARED, params)


def body_lines(rendered) -> list[str]:
    text = rendered.text
    return [line.strip() for line in text[text.index("{") + 1:text.rindex("}")].splitlines()
            if line.strip()]


def test_header_entry_and_block_limit():
    r = render("ret;", MODE="b", THREADS=128)
    assert r.text.startswith(".version 3.0\n.target sm_20\n.address_size 64\n")
    assert r.entries["k_b"].param_types == ("u64",) and r.entries["k_b"].max_threads == 128
    assert r.label == "test(MODE=b, THREADS=128)"


def test_repeat_expands_with_index_arithmetic_and_nests():
    r = render("@repeat I 2\n@repeat J THREADS // 32\n"
               "add.u32 %r${I * 2 + J}, ${J * 4};\n@end\n@end")
    assert body_lines(r) == ["add.u32 %r0, 0;", "add.u32 %r1, 4;",
                             "add.u32 %r2, 0;", "add.u32 %r3, 4;"]


def test_if_else_selects_by_parameter():
    source = '@if MODE == "a"\nmov.u32 %x, 1;\n@else\nmov.u32 %x, 2;\n@end'
    assert body_lines(render(source, MODE="a")) == ["mov.u32 %x, 1;"]
    assert body_lines(render(source, MODE="b")) == ["mov.u32 %x, 2;"]


def test_predicated_instructions_are_not_directives():
    assert body_lines(render("@%p bra L;\n@!%p ret;")) == ["@%p bra L;", "@!%p ret;"]


@pytest.mark.parametrize("value, bits", [(1.0, "0f3F800000"), (-8.0, "0fC1000000"),
                                          (0.1, "0f3DCCCCCD"), (0.0, "0f00000000")])
def test_float_immediates_are_exact_hex(value, bits):
    assert ptx.f32(value) == bits
    rendered = render(f"mul.f32 %x, %y, ${{f32({value!r})}};")
    assert body_lines(rendered) == [f"mul.f32 %x, %y, {bits};"]


BAD_BODIES = {
    "unknown-name": "add.u32 %r, ${NOPE};",
    "unclosed-placeholder": "add.u32 %r, ${MODE;",
    "float-without-f32": "add.f32 %r, ${1 / 2};",
    "attribute-access": "add.u32 %r, ${MODE.upper};",
    "call-other-than-f32": "add.u32 %r, ${len(MODE)};",
    "repeat-without-end": "@repeat I 2\nret;",
    "end-without-block": "@end",
    "two-else": "@if 1\n@else\n@else\n@end",
    "repeat-shadows-parameter": "@repeat MODE 2\n@end",
    "negative-repeat": "@repeat I 0 - 1\n@end",
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_templates_raise(body):
    with pytest.raises(FermijitError):
        render(body)


def test_compiled_expressions_take_each_render_s_values():
    """Expressions are parsed once a process (ptx._compiled): the values still come from each
    render's parameters, and a bad expression fails every time, not only the first."""
    source = "mov.u32 %x, ${THREADS * 2 + (MODE == \"a\")};"
    assert body_lines(render(source, MODE="a", THREADS=64)) == ["mov.u32 %x, 129;"]
    assert body_lines(render(source, MODE="b", THREADS=128)) == ["mov.u32 %x, 256;"]
    for _ in range(2):
        with pytest.raises(FermijitError, match="NOPE"):
            render("add.u32 %r, ${NOPE + 1};")


BAD_PARAMS = {
    "value-not-allowed": {"MODE": "c"},
    "wrong-type": {"THREADS": 64.0},
    "bool-for-int": {"THREADS": True},
    "unknown-parameter": {"EXTRA": 1},
}


@pytest.mark.parametrize("params", BAD_PARAMS.values(), ids=BAD_PARAMS.keys())
def test_bad_parameters_raise(params):
    with pytest.raises(FermijitError):
        render("ret;", **params)


def test_missing_parameter_raises():
    with pytest.raises(FermijitError, match="missing"):
        ptx.render_source("test", ENTRY.replace("BODY", "ret;"), DECLARED, {"MODE": "a"})


@pytest.mark.parametrize("source", [
    ENTRY.replace(".maxntid ${THREADS}, 1, 1\n", ""),
    ENTRY.replace(".maxnreg 63", ".maxnreg 64"),
    ENTRY.replace(".maxnreg 63\n", ""),
    ".version 4.0\n" + ENTRY,
], ids=["no-maxntid", "maxnreg-over-63", "no-maxnreg", "own-version"])
def test_entries_must_declare_fermi_limits(source):
    with pytest.raises(FermijitError):
        ptx.render_source("test", source.replace("BODY", "ret;"), DECLARED,
                          {"MODE": "a", "THREADS": 64})


def test_every_shipped_variant_renders():
    names = ptx.template_names()
    assert {"q4_gemm", "fma_probe", "copy", "embedding"} <= set(names)
    for name in names:
        for params in ptx.variants(name):
            rendered = ptx.render(name, **params)
            assert "${" not in rendered.text and rendered.entries


def test_unknown_template_raises():
    with pytest.raises(FermijitError):
        ptx.render("no_such_kernel")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The rendered-text store in a folder of the test's own, each process cache emptied."""
    monkeypatch.setattr(ptx, "_store_dir", lambda: tmp_path)
    ptx._render.cache_clear()
    yield tmp_path
    ptx._render.cache_clear()


def fresh(name: str, **params) -> ptx.Rendered:
    """`name` rendered from its template now, no store."""
    source = (ptx._TEMPLATE_DIR / f"{name}.ptx").read_text()
    return ptx.render_source(name, source, ptx.declared_params(name), params)


def test_stored_text_is_the_rendered_text(store):
    params = ptx.variants("copy")[0]
    first = ptx.render("copy", **params)                     # rendered and stored
    (path,) = store.glob("copy-*.ptx")
    ptx._render.cache_clear()
    again = ptx.render("copy", **params)                     # read back
    assert again == first == fresh("copy", **params)
    assert path.read_text().endswith(first.text)


def test_altered_or_torn_store_is_rendered_again(store):
    params = ptx.variants("copy")[0]
    ptx.render("copy", **params)
    (path,) = store.glob("copy-*.ptx")
    whole = path.read_text()
    for broken in (whole.replace("ret;", "exit;", 1), whole[:len(whole) // 2], ""):
        path.write_text(broken)
        ptx._render.cache_clear()
        assert ptx.render("copy", **params) == fresh("copy", **params)
        assert path.read_text() == whole                     # stored again, whole


def test_store_checks_parameters_first(store):
    name = next(n for n in ptx.template_names() if ptx.declared_params(n))
    params = ptx.variants(name)[0]
    ptx.render(name, **params)
    with pytest.raises(FermijitError):                       # a value not declared
        ptx.render(name, **{k: "no" for k in params})
    with pytest.raises(FermijitError, match="missing"):
        ptx.render(name)


def test_store_off(tmp_path, monkeypatch):
    monkeypatch.setenv(ptx.STORE_ENV, "0")
    ptx._store_dir.cache_clear()
    try:
        assert ptx._store_dir() is None
    finally:
        ptx._store_dir.cache_clear()
