"""`python -m fermijit bench vision` at one block and a small image: the table and the JSON."""

import json

from fermijit.bench import vision as bench_vision
from fermijit.model.config import VisionConfig
from tests.cli import run_cli


def test_bench_vision_json_and_table(monkeypatch, capsys):
    args = ("bench", "vision", "--depth", "1", "--size", "64x48", "--repeat", "1",
            "--threads", "1")
    code, out, err = run_cli(monkeypatch, capsys, *args, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["depth"] == 1 and report["hidden"] == 1152
    (row,) = report["images"]
    # 64x48 is below min_pixels (256²): scaled by sqrt(65536 / 3072), rounded up to 320x224
    # (multiples of 32) -> 20x14 patches -> 70 tokens
    assert row["image"] == "64x48" and row["patches"] == 20 * 14 and row["tokens"] == 70
    assert row["cpu_s"] > 0 and row["cpu_gflop_per_s"] > 0
    bench_vision.print_table(bench_vision.REAL, report["images"], 1)  # the table of those rows
    out = capsys.readouterr().out
    assert "64x48" in out and "CPU s" in out and "GPU s" not in out


def test_flop_count_of_the_real_tower():
    """1024x768 -> 3072 patches: 3.76 TFLOP, a third of it the attention (MODEL.md §7 shapes)."""
    flops = bench_vision.tower_flops(VisionConfig(out_hidden_size=2048), 3072)
    linears = 2 * 3072 * 27 * (4 * 1152 ** 2 + 2 * 1152 * 4304)   # qkv, proj, fc1, fc2
    attention = 2 * 27 * 2 * 3072 ** 2 * 1152                      # q·kᵀ and p·v
    ends = 2 * 3072 * 1536 * 1152 + 2 * 768 * (4608 ** 2 + 4608 * 2048)  # patches, merger
    assert flops == linears + attention + ends
    assert 3.7e12 < flops < 3.8e12


def test_bad_size_is_one_line(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "bench", "vision", "--size", "big")
    assert code == 2 and "WIDTHxHEIGHT" in err
