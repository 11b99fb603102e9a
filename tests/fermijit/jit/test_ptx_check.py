"""`kernels check`: every shipped PTX variant assembles for .target sm_20 within Fermi's limits,
and instructions Fermi lacks are caught. Needs ptxas (CUDA toolkit or the nvidia-cuda-nvcc
wheel), not a GPU nor pycuda."""

import json

import pytest
from click.testing import CliRunner

from fermijit.cli import cli
from fermijit.jit import ptx_check as kernels_check
from fermijit.jit import ptx

DECLARED = {}
KERNEL = """.visible .entry probe(.param .u64 p_out)
.maxntid 128, 1, 1
.maxnreg 63
{
    .reg .u64 %p_out;
    .reg .f32 %v;
    .reg .b16 %h;
    ld.param.u64 %p_out, [p_out];
    cvta.to.global.u64 %p_out, %p_out;
    ld.global.f32 %v, [%p_out];
BODY
    st.global.f32 [%p_out], %v;
    ret;
}
"""


def assemble(body: str):
    rendered = ptx.render_source("probe", KERNEL.replace("BODY", body), DECLARED, {})
    return kernels_check.assemble(rendered, kernels_check.find_ptxas())


def test_all_shipped_kernels_conform():
    reports = kernels_check.check_all()
    assert {r.entry for r in reports} >= {"q4_gemm_dense", "q4_gemm_expert_gate_up",
                                          "q4_gemm_expert_down", "fma_probe", "copy"}
    bad = [f"{r.variant} {r.entry}: {r.problems}" for r in reports if not r.is_ok]
    assert not bad, bad
    for r in reports:
        assert 0 < r.registers <= ptx.FERMI_MAX_REGISTERS
        assert r.shared_bytes <= ptx.FERMI_MAX_SHARED_BYTES


def test_cli_prints_table_and_json():
    result = CliRunner().invoke(cli, ["kernels", "check"])
    assert result.exit_code == 0, result.output
    assert "q4_gemm_dense" in result.output and "0 fail" in result.output
    result = CliRunner().invoke(cli, ["kernels", "check", "--json"])
    assert result.exit_code == 0, result.output
    kernels = json.loads(result.output)["kernels"]
    assert kernels and all(k["ok"] for k in kernels)


def test_fermi_instructions_pass():
    (report,) = assemble("    fma.rn.f32 %v, %v, %v, 0f3F800000;\n    cvt.rn.f16.f32 %h, %v;\n"
                         "    cvt.f32.f16 %v, %h;")
    assert report.is_ok and report.registers > 0


@pytest.mark.parametrize("body", [
    "    shfl.idx.b32 %v, %v, 0, 31;",                       # warp shuffle is sm_30
    "    .reg .b32 %i;\n    dp4a.u32.u32 %i, %i, %i, %i;",      # dp4a is sm_61
    "    add.f16 %h, %h, %h;",                               # fp16 arithmetic is sm_53
    "    ld.global.nc.f32 %v, [%p_out];",                    # the read-only cache path is sm_32
], ids=["shfl", "dp4a", "fp16-add", "ld-nc"])
def test_instructions_fermi_lacks_are_rejected(body):
    (report,) = assemble(body)
    assert not report.is_ok and report.problems


def test_shared_memory_over_48k_fails():
    (report,) = assemble("    .shared .align 4 .f32 big[12400];\n    .reg .u32 %a;\n"
                         "    mov.u32 %a, big;\n    st.shared.f32 [%a], %v;\n"
                         "    ld.shared.f32 %v, [%a+49000];")
    assert not report.is_ok and "shared" in report.problems[0]


def test_block_over_1024_threads_fails():
    rendered = ptx.render_source("probe", KERNEL.replace("BODY", "").replace(
        ".maxntid 128, 1, 1", ".maxntid 64, 32, 1"), DECLARED, {})
    (report,) = kernels_check.assemble(rendered, kernels_check.find_ptxas())
    assert report.max_threads == 2048 and not report.is_ok
