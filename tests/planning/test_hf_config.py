"""A Hugging Face causal LM's size from its config: counted on the meta device with transformers and
from the config's fields without it, the two equal to the model's own parameters for each family the
fields cover; plan-memory and doctor size a job by it."""

from __future__ import annotations

import json

import pytest

from netoptim.planning.hf_config import HFConfigError, model_size
from tests.cli import run_netoptim

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SMALL = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3, "num_attention_heads": 4}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2),
    "llama-tied": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True),
    "llama-biases": lambda: transformers.LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True),
    "mistral": lambda: transformers.MistralConfig(**SMALL, num_key_value_heads=1),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=2),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=1000, n_positions=128, n_embd=64, n_layer=3, n_head=4),
}


def _saved(tmp_path, config) -> tuple[str, int]:
    """``config`` saved as a model directory, and its model's own count (tied weights once)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    config.save_pretrained(tmp_path)
    return str(tmp_path), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_count_is_the_models_own_with_and_without_transformers(tmp_path, family):
    directory, expected = _saved(tmp_path, CONFIGS[family]())
    exact = model_size(directory, use_transformers=True)
    from_fields = model_size(directory, use_transformers=False)
    assert exact.params == from_fields.params == expected
    assert exact.layers == 3 and exact.hidden == 64 and from_fields.counted_by == "the config's fields"
    assert model_size(tmp_path / "config.json").params == expected  # the file itself names it as well


def test_a_family_the_fields_do_not_fix_needs_transformers_and_says_so(tmp_path):
    directory, expected = _saved(
        tmp_path, transformers.PhiConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    )
    assert model_size(directory).params == expected
    with pytest.raises(HFConfigError, match=r"config\.json: counting a 'phi' model needs transformers \(pip install 'netoptim-train\[integrations\]'\)"):
        model_size(directory, use_transformers=False)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "not a readable JSON config"),
        (json.dumps({"hidden_size": 8}), 'no "model_type"'),
        (
            json.dumps({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16}),
            "'num_hidden_layers' or 'n_layer'",
        ),
    ],
    ids=["missing", "not-json", "no-model-type", "no-layers"],
)
def test_a_config_that_cannot_size_a_model_is_named(tmp_path, content, message):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(HFConfigError, match=message) as info:
        model_size(tmp_path, use_transformers=False)
    assert str(tmp_path / "config.json") in str(info.value)


def test_plan_memory_and_doctor_size_a_job_by_the_config(tmp_path):
    directory, expected = _saved(tmp_path, CONFIGS["llama"]())
    by_config = run_netoptim("plan-memory", "--hf-config", directory, "--workers", "2", "--json")
    by_count = run_netoptim("plan-memory", "--params", str(expected), "--workers", "2", "--json")
    assert by_config.returncode == 0, by_config.stderr
    assert json.loads(by_config.stdout)["params"] == expected and json.loads(by_config.stdout)["per_node"] == json.loads(by_count.stdout)["per_node"]
    both = run_netoptim("plan-memory", "--hf-config", directory, "--params", "3B", "--workers", "2")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    broken = run_netoptim("plan-memory", "--hf-config", str(tmp_path / "nowhere"), "--workers", "2")
    assert broken.returncode == 2 and "nowhere: no such file (give a model directory with a config.json" in broken.stderr
    doctor = run_netoptim("doctor", "--no-host", "--state-dir", str(tmp_path / "state"), "--hf-config", directory, "--probe-bytes", "0", "--json")
    assert doctor.returncode == 0, doctor.stderr
    space = next(f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "free space")
    assert space["figures"]["needed_bytes"] == 12 * expected * (1 + 3), "its state and the node's 3 checkpoints"


@pytest.mark.parametrize(("family", "shape"), [("llama", (3, 64, 4)), ("gpt2", (3, 64, 4))])
def test_plan_takes_the_configs_depth_width_and_heads(tmp_path, family, shape):
    from netoptim.cli.plan import validate_model_flags
    from netoptim.console import build_parser

    directory, _ = _saved(tmp_path, CONFIGS[family]())
    args = build_parser().parse_args(["plan", "--hf-config", directory, "--n-layer", "99"])
    validate_model_flags(args)
    assert (args.n_layer, args.n_embd, args.n_head) == shape  # the config's, whatever the GPT flags say


def test_plan_names_a_config_it_cannot_read(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    result = run_netoptim("plan", "--hf-config", str(tmp_path))
    assert result.returncode != 0 and "config.json" in result.stderr and "num_hidden_layers" in result.stderr
