"""Property tests: every bad input gets the documented error, every accepted one obeys the rules.

Fuzzed: ``HiSparseConfig.from_json`` / ``from_dict`` (and their ``model_top_k`` /
``num_draft_tokens``), every ``SGLANG_HISPARSE_*`` variable and ``envs.source`` / ``envs.get``
names, the planner's arguments, ``--model-config`` files and ``--trace`` files. The test fails
on any exception other than the documented one (``ValueError`` in the libraries; exit status 2
with one ``error:`` line naming the flag, or argparse's usage + error, in the CLI) and on an
accepted value that breaks a documented rule.

The default suite runs a bounded number of examples per test (about a second each); the
``slow`` sweep runs 20x more: ``pytest tests/unit/test_fuzz_inputs.py -m slow``. Hypothesis
draws fresh examples on every run and prints a failing one with its seed
(``@reproduce_failure``) so it can be replayed. The counts of inputs run are printed at the end
of the module (``-s`` shows them).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sglang_hisparse import envs
from sglang_hisparse.cli.main import build_parser
from sglang_hisparse.config import (
    FLAG,
    MAX_BLOCK_SIZE,
    MAX_DEVICE_BUFFER_SIZE,
    WARP,
    HiSparseConfig,
)
from sglang_hisparse.kernel_limits import (
    SM90_MAX_SMEM_PER_BLOCK,
    resolve_smem_bytes,
    verify_smem_bytes,
)
from sglang_hisparse.traces.format import TraceWriter, load_trace, make_header

FAST = 100  # the cheap parsers; the planner runs take FAST // 2
SLOW = 3000
COUNTS: Counter[str] = Counter()


def _settings(n: int):
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    print(f"\nfuzzed inputs: {sum(COUNTS.values())} ({', '.join(f'{k} {v}' for k, v in sorted(COUNTS.items()))})")


# ----------------------------------------------------------------------------- strategies
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-70000, max_value=70000),
    st.sampled_from([0, 1, 31, 32, 64, 512, 1024, 2048, 4096, 32767, 32768, 10**5000 // 10**4990]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([64.0, 2048.0, 1e300]), st.text(max_size=8),
)
json_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
_non_json = st.one_of(st.frozensets(st.integers(), max_size=2), st.binary(max_size=4), st.tuples(st.integers()),
                      st.just(object()), st.complex_numbers(allow_nan=True))
_keys = st.one_of(st.sampled_from(HiSparseConfig.keys()), st.text(max_size=6), st.integers(), st.none())
config_dicts = st.dictionaries(_keys, json_values | _non_json, max_size=4)
valid_like = st.fixed_dictionaries({}, optional={
    "top_k": st.sampled_from([1, 4, 64, 2048, 0, -1, True]),
    "device_buffer_size": st.integers(min_value=-2, max_value=40000),
    "host_to_device_ratio": st.integers(min_value=-1, max_value=10**6),
    "swap_in_block_size": st.one_of(st.none(), st.integers(min_value=-64, max_value=2100)),
})
_arg_values = st.one_of(st.none(), st.booleans(), st.integers(min_value=-5, max_value=40000), st.integers(),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), st.just([2048]))


def _deep(n: int, open_: str, close: str) -> str:
    return open_ * n + close * n


config_texts = st.one_of(
    json_values.map(json.dumps),
    valid_like.map(json.dumps),
    st.text(max_size=40),
    valid_like.map(json.dumps).flatmap(lambda t: st.integers(0, max(len(t) - 1, 0)).map(lambda i: t[:i])),
    st.integers(min_value=1, max_value=5000).map(lambda n: _deep(n, "[", "]")),
    st.integers(min_value=1, max_value=5000).map(lambda n: '{"a":' * n),
    st.integers(min_value=4290, max_value=4400).map(lambda n: '{"top_k": ' + "9" * n + "}"),
    st.sampled_from(["{'top_k': 64}", '{"top_k": True}', '{"top_k": NaN}', '{"top_k": Infinity}',
                     '{"device_buffer_size": 4096,}', "null", "[]", '""', " ", "\x00"]),
)


# ----------------------------------------------------------------------------- config
def _check_config_rules(cfg: HiSparseConfig, model_top_k, W: int) -> None:
    """What docs/configuration.md promises of an accepted config."""
    for value in (cfg.top_k, cfg.device_buffer_size, cfg.host_to_device_ratio):
        assert type(value) is int, cfg
    k, B = cfg.top_k, cfg.device_buffer_size
    assert k >= 1 and (model_top_k is None or k == model_top_k)
    assert k <= B <= MAX_DEVICE_BUFFER_SIZE and B >= W * k
    assert cfg.host_to_device_ratio >= 1
    block = cfg.swap_in_block_size
    assert block is None or (type(block) is int and WARP <= block <= MAX_BLOCK_SIZE and block % WARP == 0)
    assert resolve_smem_bytes(k, B) <= SM90_MAX_SMEM_PER_BLOCK
    assert not W or verify_smem_bytes(k, B, W) <= SM90_MAX_SMEM_PER_BLOCK


def _config_outcome(fn, model_top_k, W) -> None:
    try:
        cfg = fn()
    except ValueError as e:
        msg = str(e)
        assert msg and any(n in msg for n in (FLAG, "index_topk", "--speculative-num-draft-tokens",
                                              "speculative_num_draft_tokens")), msg
        return
    _check_config_rules(cfg, model_top_k, W)


def _w(num_draft_tokens) -> int:
    return 0 if num_draft_tokens is None else num_draft_tokens


def _fuzz_from_json(text, model_top_k, num_draft_tokens) -> None:
    COUNTS["config"] += 1
    _config_outcome(lambda: HiSparseConfig.from_json(text, model_top_k=model_top_k, num_draft_tokens=num_draft_tokens),
                    model_top_k, _w(num_draft_tokens))


def _fuzz_from_dict(raw, model_top_k, num_draft_tokens) -> None:
    COUNTS["config"] += 1
    _config_outcome(lambda: HiSparseConfig.from_dict(raw, model_top_k=model_top_k, num_draft_tokens=num_draft_tokens),
                    model_top_k, _w(num_draft_tokens))


_topk_args = st.one_of(st.none(), st.sampled_from([4, 64, 2048]), _arg_values)
_w_args = st.one_of(st.sampled_from([0, 1, 2, 4, None]), _arg_values)


@_settings(FAST)
@given(config_texts, _topk_args, _w_args)
def test_from_json(text, model_top_k, num_draft_tokens):
    _fuzz_from_json(text, model_top_k, num_draft_tokens)


@_settings(FAST)
@given(config_dicts | valid_like | json_values, _topk_args, _w_args)
def test_from_dict(raw, model_top_k, num_draft_tokens):
    _fuzz_from_dict(raw, model_top_k, num_draft_tokens)


@pytest.mark.slow
@_settings(SLOW)
@given(config_texts, _topk_args, _w_args)
def test_from_json_sweep(text, model_top_k, num_draft_tokens):
    _fuzz_from_json(text, model_top_k, num_draft_tokens)


@pytest.mark.slow
@_settings(SLOW)
@given(config_dicts | valid_like | json_values, _topk_args, _w_args)
def test_from_dict_sweep(raw, model_top_k, num_draft_tokens):
    _fuzz_from_dict(raw, model_top_k, num_draft_tokens)


# ----------------------------------------------------------------------------- environment
_ENV_NAMES = sorted({n for name, var in envs.registry().items() for n in (name, *var.legacy)})
env_values = st.one_of(
    st.sampled_from(["", " ", "0", "1", "-1", "2", "0.5", "nan", "NaN", "inf", "-inf", "1e400", "30", "true",
                     "False", "yes", "off", "maybe", "0x10", "1_000", " 1 ", "\t"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8),
)


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {n: os.environ.get(n) for n in _ENV_NAMES}
    try:
        for n in _ENV_NAMES:
            os.environ.pop(n, None)
        os.environ.update(values)
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def _check_env(name: str, var: envs.EnvVar) -> None:
    src = envs.source(name)
    assert src is None or src in (name, *var.legacy)
    try:
        value = envs.get(name)
    except ValueError as e:
        assert src is not None and src in str(e), (name, str(e))
        return
    assert type(value) is var.kind, (name, value)
    if src is None:
        assert value == var.default  # unset, or set to the empty string: the default
    if var.kind is float:
        assert math.isfinite(value)
    if name == "SGLANG_HISPARSE_LOG_INTERVAL":
        assert value >= 0
    if name == "SGLANG_HISPARSE_RECORD_SAMPLE":
        assert 0 <= value <= 1
    if name == "SGLANG_HISPARSE_RECORD_NEXT_BEST":
        assert value >= 0


def _fuzz_env(values: dict[str, str], unknown: str) -> None:
    COUNTS["env"] += len(values) + 1
    with _environ(values):
        for name, var in envs.registry().items():
            _check_env(name, var)
    if unknown not in envs.registry():
        for fn in (envs.get, envs.source):
            with pytest.raises(ValueError, match="unknown sglang_hisparse environment variable"):
                fn(unknown)
            with pytest.raises(KeyError):
                fn(unknown)


_env_sets = st.dictionaries(st.sampled_from(_ENV_NAMES), env_values, max_size=len(_ENV_NAMES))
_unknown = st.one_of(st.text(max_size=12), st.sampled_from(["X", "SGLANG_HISPARSE_LOG_INTERVALS", "sglang_hisparse_skip_io"]))


@_settings(FAST)
@given(_env_sets, _unknown)
def test_env_variables(values, unknown):
    _fuzz_env(values, unknown)


@pytest.mark.slow
@_settings(SLOW)
@given(_env_sets, _unknown)
def test_env_variables_sweep(values, unknown):
    _fuzz_env(values, unknown)


def test_env_rules_named_in_the_issue(monkeypatch):
    monkeypatch.setenv("SGLANG_HISPARSE_LOG_INTERVAL", "nan")
    with pytest.raises(ValueError, match=r"SGLANG_HISPARSE_LOG_INTERVAL='nan' must be a finite number of seconds >= 0"):
        envs.get("SGLANG_HISPARSE_LOG_INTERVAL")
    monkeypatch.setenv("SGLANG_HISPARSE_LOG_INTERVAL", "-1")
    with pytest.raises(ValueError, match=r"\(0 disables reporting\)"):
        envs.get("SGLANG_HISPARSE_LOG_INTERVAL")
    monkeypatch.setenv("SGLANG_HISPARSE_LOG_INTERVAL", "")  # empty counts as unset
    assert envs.get("SGLANG_HISPARSE_LOG_INTERVAL") == 30.0 and envs.source("SGLANG_HISPARSE_LOG_INTERVAL") is None
    for bad in ("nan", "inf", "-1", "2"):
        monkeypatch.setenv("SGLANG_HISPARSE_RECORD_SAMPLE", bad)
        with pytest.raises(ValueError, match=r"must be a fraction in \[0, 1\]"):
            envs.get("SGLANG_HISPARSE_RECORD_SAMPLE")
    with pytest.raises(ValueError, match=r"unknown sglang_hisparse environment variable 'X'"):
        envs.source("X")
    with pytest.raises(ValueError, match="did you mean SGLANG_HISPARSE_SKIP_IO"):
        envs.get("SGLANG_HISPARSE_SKIP_I0")


# ----------------------------------------------------------------------------- planner CLI
_PARSER = build_parser()
_KNOWN_FLAGS = {o for a in _PARSER._subparsers._group_actions[0].choices["plan"]._actions
                for o in a.option_strings if o.startswith("--") and o != "--help"}
_number_text = st.one_of(
    st.sampled_from(["inf", "-inf", "nan", "1e400", "1e300", "-1", "0", "-0", "0.5", "1", "2", "8", "50", "140",
                     "1e-300", "4096", "2048", "99999999999999999999", "", "abc", "1,5"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-10, max_value=10**12).map(str),
)
_context_text = st.one_of(_number_text, st.sampled_from(["128K", "32k,64k", "1M", "1.5K", "0.1K", "inf", "1e400K",
                                                          "128K,", ",", "2147483648", "-inf"]))
_FLAGS = {
    "--context": _context_text, "--gpu-hbm-gib": _number_text, "--kv-share": _number_text,
    "--kv-budget-gib": _number_text, "--tp": _number_text, "--host-dram-gib": _number_text,
    "--link-gbps": _number_text, "--buffer": _number_text, "--miss-rate": _number_text,
    "--target-step-ms": _number_text, "--min-gain": _number_text,
    "--kv-dtype": st.sampled_from(["bf16", "fp8", "fp16"]),
    "--model": st.sampled_from(["GLM-5.1", "glm-5.2", "DeepSeek-V3.2", "llama"]),
    "--hisparse-index-layers": st.sampled_from(["all", "anchors", "some"]),
}
plan_argvs = st.dictionaries(st.sampled_from(sorted(_FLAGS)), st.none(), max_size=4).flatmap(
    lambda keys: st.fixed_dictionaries({k: _FLAGS[k] for k in keys}))
_OUTPUT = st.sampled_from([[], ["--json"], ["--emit-config"]])


def _run_plan(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            args = _PARSER.parse_args(["plan", *argv])
        except SystemExit as e:  # argparse: usage line + error
            return int(e.code), out.getvalue(), err.getvalue()
        code = args._run(args)
    return code, out.getvalue(), err.getvalue()


def _check_plan_outcome(argv: list[str], code: int, out: str, err: str) -> None:
    if code == 2:
        lines = err.strip().splitlines()
        assert lines and "Traceback" not in err, err
        last = lines[-1]
        assert last.startswith(("error: ", "python -m sglang_hisparse plan: error: ")), err
        assert len(lines) == 1 or last.startswith("python -m sglang_hisparse plan: error: "), err
        assert any(f in last for f in _KNOWN_FLAGS), err  # names a flag (maybe one left at its default)
        return
    assert code == 0, (code, err)
    if "--emit-config" in argv:
        config_line, flags_line = out.splitlines()[:2]
        assert "--max-running-requests" in flags_line
        if config_line:  # a config the server accepts
            cfg = json.loads(config_line)
            HiSparseConfig.from_dict(cfg, model_top_k=cfg["top_k"])
    elif "--json" in argv:
        json.loads(out)


def _fuzz_plan(values: dict[str, str], output: list[str]) -> None:
    COUNTS["plan args"] += 1
    argv = [f"{k}={v}" for k, v in values.items()] + output
    _check_plan_outcome(argv, *_run_plan(argv))


@_settings(FAST // 2)
@given(plan_argvs, _OUTPUT)
# found by the sweep: a subnormal miss rate made the link bound infinite (int(inf) raised)
@example({"--buffer": "4096", "--miss-rate": "2.2250738585072014e-308"}, [])
def test_plan_arguments(values, output):
    _fuzz_plan(values, output)


@pytest.mark.slow
@_settings(SLOW)
@given(plan_argvs, _OUTPUT)
def test_plan_arguments_sweep(values, output):
    _fuzz_plan(values, output)


# ----------------------------------------------------------------------------- --model-config files
_SHAPE = {"num_hidden_layers": 78, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128,
          "index_topk": 2048}
_model_value = st.one_of(json_values, st.sampled_from([True, False, 0, -1, 1, 64, 78, 2**40, 1.0, "78"]))
_sharing = st.fixed_dictionaries({}, optional={
    "indexer_types": st.one_of(json_values, st.lists(st.sampled_from(["full", "shared"]), max_size=80)),
    "index_topk_pattern": st.one_of(json_values, st.text(alphabet="FS", max_size=80)),
    "index_topk_freq": _model_value, "cli_factor": _model_value, "index_skip_topk_offset": _model_value,
})
model_configs = st.one_of(
    st.tuples(st.fixed_dictionaries({}, optional={k: st.one_of(st.just(v), _model_value) for k, v in _SHAPE.items()}),
              _sharing).map(lambda t: json.dumps({**t[0], **t[1]})),
    json_values.map(json.dumps),
    st.integers(min_value=1, max_value=5000).map(lambda n: _deep(n, '{"a":', "}") if n % 2 else _deep(n, "[", "]")),
    st.sampled_from(["", "{", '{"num_hidden_layers": 78,}', "\ufeff{}", '{"num_hidden_layers": ' + "7" * 5000 + "}"]),
    st.binary(max_size=16).map(lambda b: b.decode("latin-1")),
)


def _fuzz_model_config(text: str, output: list[str]) -> None:
    COUNTS["model configs"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        argv = ["--model-config", str(path), *output]
        _check_plan_outcome(argv, *_run_plan(argv))


@_settings(FAST // 2)
@given(model_configs, _OUTPUT)
def test_plan_model_config_files(text, output):
    _fuzz_model_config(text, output)


@pytest.mark.slow
@_settings(SLOW)
@given(model_configs, _OUTPUT)
def test_plan_model_config_files_sweep(text, output):
    _fuzz_model_config(text, output)


def test_true_is_not_one_in_a_model_config(tmp_path):
    for key in ("num_hidden_layers", "index_topk"):
        (tmp_path / "config.json").write_text(json.dumps({**_SHAPE, key: True}))
        code, _, err = _run_plan(["--model-config", str(tmp_path)])
        assert code == 2 and f"{key} = true must be an integer" in err, err


# ----------------------------------------------------------------------------- --trace files
def _good_trace(path: Path, rng: np.random.Generator) -> bytes:
    with TraceWriter(str(path), make_header(top_k=4, sorted_by_score=True)) as w:
        for step in range(int(rng.integers(1, 12))):
            n = 9 + step
            w.add(stream=0, layer=0, seq_len=n, positions=rng.choice(n, 4, replace=False))
    return path.read_bytes()


def _npz_with(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as f:
        np.savez(f, **arrays)


_header_values = st.one_of(json_values, st.fixed_dictionaries(
    {"format": st.just("sglang-hisparse-trace"), "version": st.just(1)},
    optional={"top_k": _model_value, "sorted_by_score": _model_value}))
trace_cases = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=4)),
    st.tuples(st.just("header"), _header_values.map(json.dumps) | st.text(max_size=10)),
    st.tuples(st.just("arrays"), st.sampled_from(["float", "2d", "0d", "empty", "object-free-str"])),
    st.tuples(st.just("raw"), st.sampled_from([b"", b"PK\x03\x04", b"\x93NUMPY", b"PK\x05\x06" + bytes(18)])),
    st.tuples(st.just("npy"), st.just(None)),
)


def _write_case(path: Path, case, seed: int) -> None:
    kind, arg = case
    rng = np.random.default_rng(seed)
    good = _good_trace(path, rng)
    if kind == "truncate":
        path.write_bytes(good[: int(arg * len(good))])
    elif kind == "flip":
        data = bytearray(good)
        for where, byte in arg:
            data[min(int(where * len(data)), len(data) - 1)] = byte
        path.write_bytes(bytes(data))
    elif kind == "header":
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        _npz_with(path, {**arrays, "header": np.array(arg)})
    elif kind == "arrays":
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        victim = ("stream", "layer", "seq_len", "offsets", "positions")[seed % 5]
        a = arrays[victim]
        arrays[victim] = {"float": a.astype(np.float32), "2d": a.reshape(1, -1), "0d": np.array(a.ravel()[:1].sum()),
                          "empty": a[:0], "object-free-str": a.astype(str)}[arg]
        _npz_with(path, arrays)
    elif kind == "raw":
        path.write_bytes(arg)
    else:
        with open(path, "wb") as f:
            np.save(f, np.arange(5))


def _fuzz_trace(case, seed: int, through_plan: bool) -> None:
    COUNTS["trace files"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.npz"
        _write_case(path, case, seed)
        try:
            trace = load_trace(path)
        except ValueError as e:
            assert str(e), case
        else:
            top_k = trace.header.get("top_k")
            assert top_k is None or (type(top_k) is int and top_k >= 0)
        if through_plan:
            argv = ["--trace", str(path), "--buffer", "4096"]
            code, out, err = _run_plan(argv)
            _check_plan_outcome(argv, code, out, err)
            assert "--buffer -" not in err, err  # a header's top_k is not the user's --buffer


@_settings(FAST // 2)
@given(trace_cases, st.integers(0, 2**16), st.booleans())
def test_trace_files(case, seed, through_plan):
    _fuzz_trace(case, seed, through_plan)


@pytest.mark.slow
@_settings(SLOW)
@given(trace_cases, st.integers(0, 2**16), st.booleans())
def test_trace_files_sweep(case, seed, through_plan):
    _fuzz_trace(case, seed, through_plan)


def test_negative_header_top_k_is_blamed_on_the_trace(tmp_path):
    path = tmp_path / "t.npz"
    _write_case(path, ("header", json.dumps({"format": "sglang-hisparse-trace", "version": 1, "top_k": -64})), 0)
    code, _, err = _run_plan(["--trace", str(path)])
    assert code == 2 and "header 'top_k' = -64 must be an integer >= 0" in err and "--buffer" not in err, err
