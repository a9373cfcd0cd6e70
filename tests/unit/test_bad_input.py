"""Bad input to the operator tools: each is one line on stderr that names the flag and the
fix, exit status 2 (doctor: a FAIL line), and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_hisparse.cli import doctor
from sglang_hisparse.cli.main import main
from sglang_hisparse.config import HiSparseConfig

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tests" / "data" / "smollm2_shakespeare.npz"
SIM = ["simulate", "--policy", "lru", "--buffer", "512"]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, err


@pytest.fixture
def truncated_trace(tmp_path) -> Path:
    path = tmp_path / "truncated.npz"
    path.write_bytes(TRACE.read_bytes()[:3000])  # a copy cut short: zip magic, no central directory
    return path


@pytest.fixture
def garbage_trace(tmp_path) -> Path:
    path = tmp_path / "garbage.npz"
    path.write_bytes(bytes(range(256)) * 4)
    return path


def test_simulate_truncated_trace(capsys, truncated_trace):
    code, out, err = _cli(capsys, *SIM, "--trace", str(truncated_trace))
    assert code == 2 and out == ""
    _one_line_error(err, "--trace", "damaged .npz", "truncated", "copy or record it again")


def test_simulate_garbage_trace_gives_no_pickle_advice(capsys, garbage_trace):
    code, out, err = _cli(capsys, *SIM, "--trace", str(garbage_trace))
    assert code == 2 and out == ""
    _one_line_error(err, "--trace", "not a .npz (zip) archive", "docs/traces.md")
    assert "pickle" not in err


@pytest.mark.parametrize("which", ["truncated_trace", "garbage_trace"])
def test_plan_bad_trace(capsys, request, which):
    code, out, err = _cli(capsys, "plan", "--trace", str(request.getfixturevalue(which)))
    assert code == 2 and out == ""
    _one_line_error(err, "--trace", ".npz")
    assert "pickle" not in err


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_simulate_output_in_missing_folder_fails_before_the_work(capsys, tmp_path, flag):
    target = tmp_path / "no-such-folder" / "out"
    code, out, err = _cli(capsys, *SIM, "--trace", str(TRACE), flag, str(target))
    assert code == 2 and out == ""  # the table is printed after the simulation: none ran
    _one_line_error(err, flag, "does not exist", "mkdir -p")


def test_plan_plot_in_missing_folder(capsys, tmp_path):
    code, out, err = _cli(capsys, "plan", "--plot", str(tmp_path / "no-such-folder" / "plan.png"))
    assert code == 2 and out == ""
    _one_line_error(err, "--plot", "does not exist", "mkdir -p")


def test_plan_json_into_a_closed_pipe_exits_quietly():
    # `plan --json | head -c1`, deterministically: the reader has gone before the first write.
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "sglang_hisparse", "plan", "--json"], stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)
    finally:
        os.close(w)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_plan_binary_model_config(capsys, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x80\x00\xff\xfe" * 64)
    code, out, err = _cli(capsys, "plan", "--model-config", str(weights))
    assert code == 2 and out == ""
    _one_line_error(err, "--model-config", "not a text file", "config.json")


def test_doctor_binary_model_config(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x80\x00\xff\xfe" * 64)
    check = doctor.check_config(None, str(weights))
    assert check.status == doctor.FAIL
    assert "--model-config" in check.detail and "not a text file" in check.detail


def test_doctor_model_config_folder_without_config_json(tmp_path):
    check = doctor.check_config(None, str(tmp_path))
    assert check.status == doctor.FAIL
    assert check.detail == (f"--model-config {tmp_path}: the folder has no config.json; pass the model's "
                            "config.json or the folder that holds it")


def test_plan_model_config_folder_without_config_json(capsys, tmp_path):
    code, out, err = _cli(capsys, "plan", "--model-config", str(tmp_path))
    assert code == 2
    _one_line_error(err, "--model-config", "has no config.json")


def test_trailing_comma_hint_names_the_comma():
    with pytest.raises(ValueError, match="remove the trailing comma before '}'") as e:
        HiSparseConfig.from_json('{"device_buffer_size": 4096,}')
    assert "Quote keys" not in str(e.value) and "quote keys" not in str(e.value)
    with pytest.raises(ValueError, match="quote keys with double quotes"):
        HiSparseConfig.from_json("{device_buffer_size: 4096}")


def test_model_config_trailing_comma_hint(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 78})[:-1] + ",}")
    code, out, err = _cli(capsys, "plan", "--model-config", str(tmp_path))
    assert code == 2
    _one_line_error(err, "--model-config", "remove the trailing comma")
