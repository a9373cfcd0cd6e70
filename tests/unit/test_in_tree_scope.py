"""What SGLang 0.5.23's in-tree HiSparse serves, against what we refuse (issue 46).

The claim examined: with the plugin installed, ``--enable-hisparse`` on a dense-attention model
with a ``--hisparse-config`` of SGLang's sparsity framework (``"algorithm": "quest"``,
``sglang/srt/mem_cache/sparsity/``) is refused, although the in-tree path would serve it. These
tests run SGLang's real argument pipeline once with our hooks and once with SGLang's original
``validate_hisparse`` put back (HookRegistry keeps it as the wrapper's ``__wrapped__``), and
scan the installed SGLang for the framework's entry point. They pin what is true in 0.5.23:

- the in-tree validation refuses a dense model too (an ``AssertionError``), so there is no
  in-tree path to fall through to, and our refusal says so;
- the framework's keys on a DSA model pass the in-tree validation, and the in-tree HiSparse then
  runs its DSA coordinator without reading them: ``create_sparse_coordinator``, the only reader
  of ``algorithm`` / ``backend`` / ``min_sparse_prompt_len`` / ``page_size``, has no caller.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("sglang_with_plugin")

#: a config of SGLang's sparsity framework (sparsity/factory.py's keys) for a dense model
QUEST = {"algorithm": "quest", "backend": "fa3", "top_k": 64, "min_sparse_prompt_len": 128}


def hisparse_flags(config: dict | str) -> list[str]:
    """``--enable-hisparse`` with ``config``, and the radix cache off as the in-tree validation asserts."""
    text = config if isinstance(config, str) else json.dumps(config)
    return ["--enable-hisparse", "--disable-radix-cache", "--hisparse-config", text]


def run_pipeline(model_dir: Path, *extra: str):
    """``prepare_server_args`` + ``resolve_once`` + ``check_server_args``, as a server runs them."""
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", str(model_dir), "--skip-tokenizer-init", "--device", "cpu", *extra])
    args.resolve_once()
    args.check_server_args()
    return args


@pytest.fixture
def in_tree_validation(monkeypatch):
    """SGLang's own ``validate_hisparse`` where ``_hisparse_validation`` looks it up, for one test."""
    from sglang.srt.arg_groups import hisparse_hook

    from sglang_hisparse.plugin import is_ours
    from sglang_hisparse.sglang_adapter.arg_hook import validate_hisparse

    assert is_ours(hisparse_hook.validate_hisparse, validate_hisparse)
    original = hisparse_hook.validate_hisparse.__wrapped__
    assert not is_ours(original, validate_hisparse)
    monkeypatch.setattr(hisparse_hook, "validate_hisparse", original)


def test_dense_model_is_refused_in_tree_too_and_ours_says_so(llama_model_dir):
    with pytest.raises(ValueError, match=(
            rf"model {llama_model_dir} \(LlamaForCausalLM\) is not a DSA model.*"
            r"SGLang 0\.5\.23's in-tree HiSparse refuses it as well.*create_sparse_coordinator has no "
            r"caller.*SGLANG_PLUGINS would not serve it either")):
        run_pipeline(llama_model_dir, *hisparse_flags(QUEST))


def test_in_tree_validation_refuses_a_dense_model(llama_model_dir, in_tree_validation):
    # SGLang's own wording (hisparse_hook.validate_hisparse); no flag lifts it
    with pytest.raises(AssertionError, match=r"--enable-hisparse is only supported for DSA"):
        run_pipeline(llama_model_dir, *hisparse_flags(QUEST))


def test_framework_keys_on_a_dsa_model_are_refused_as_ignored_in_tree(dsa_model_dir):
    with pytest.raises(ValueError, match=(
            r"unknown key\(s\) 'algorithm', 'backend', 'min_sparse_prompt_len'.*"
            r"keys of SGLang's mem_cache/sparsity framework.*no server path.*"
            r"in-tree HiSparse ignores them too.*Remove them\.$")):
        run_pipeline(dsa_model_dir, *hisparse_flags({"algorithm": "quest", "backend": "fa3",
                                                     "min_sparse_prompt_len": 128}))


def test_in_tree_validation_accepts_framework_keys_on_a_dsa_model(dsa_model_dir, in_tree_validation):
    run_pipeline(dsa_model_dir, *hisparse_flags({"algorithm": "quest", "backend": "fa3"}))


def test_a_typo_of_our_keys_keeps_our_error_without_the_framework_note(dsa_model_dir):
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'device_bufer_size'. Valid keys") as e:
        run_pipeline(dsa_model_dir, *hisparse_flags('{"device_bufer_size": 4096}'))
    assert "mem_cache/sparsity framework" not in str(e.value)


def test_sparsity_framework_has_no_caller_in_sglang():
    """If this fails, SGLang builds its sparsity framework on a server path: the configurations
    it serves there (dense attention, the framework's keys) must then fall through to the
    in-tree path with the plugin installed (issue 46), and the messages above are wrong."""
    import sglang

    root = Path(sglang.__file__).parent
    framework = root / "srt" / "mem_cache" / "sparsity"
    callers = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if framework not in p.parents and "create_sparse_coordinator" in p.read_text(errors="replace")]
    assert callers == []
