"""Your own Hugging Face causal LM, layer-wise: a model directory's sharded safetensors to the nodes a
tensor at a time, training bitwise as the same model loaded whole and trained in full-model mode;
shards that cannot give the model its values are refused, naming tensor and file, before any node
holds a value."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from gpu_worker import RemoteAdamW
from netoptim.integrations.hf_layerwise import PretrainedWeightsError, decoder_layers, offload_causal_lm
from protos import admin_pb2, admin_pb2_grpc

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SMALL = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4}
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2),
    "qwen2-tied": lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    ),  # dropout draws would differ
}
OPTIONS = {"rank": 0, "world_size": 1, "lr": 0.01, "weight_decay": 0.1, "bucket_numel": 2048}


def _saved(directory, config, dtype=torch.float32):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(directory, max_shard_size="40KB")  # several shards
    return directory


def _batch(step):
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
    return {"input_ids": tokens, "labels": tokens}


@pytest.mark.parametrize(("family", "checkpointing"), [*((family, False) for family in FAMILIES), ("llama", True)])
def test_layerwise_from_the_shards_trains_bitwise_as_the_whole_model(start_node, tmp_path, family, checkpointing):
    directory = _saved(tmp_path / "model", FAMILIES[family]())
    assert len(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    whole = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    whole.config.use_cache = False
    whole.train()
    reference = RemoteAdamW(whole.named_parameters(), nodes=[start_node("full").address], **OPTIONS)
    model, optimizer = offload_causal_lm(directory, nodes=[start_node("layerwise").address], gradient_checkpointing=checkpointing, **OPTIONS)
    for step in range(3):
        expected = whole(**_batch(step)).loss
        expected.backward()
        reference.step()
        reference.zero_grad()
        loss = model(**_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert torch.equal(loss.detach(), expected.detach()), f"step {step}: {loss.item()} against {expected.item()}"
    gathered = optimizer.gather_parameters()
    for name, value in whole.named_parameters():
        assert torch.equal(gathered[name], value.detach()), name
    reference.close()
    optimizer.close()


def test_bf16_shards_become_fp32_masters_and_layers_are_found(start_node, tmp_path):
    directory = _saved(tmp_path / "model", FAMILIES["llama"](), dtype=torch.bfloat16)
    model, optimizer = offload_causal_lm(directory, nodes=[start_node().address], **OPTIONS)
    assert len(decoder_layers(model)) == 3
    source = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.bfloat16)
    gathered = optimizer.gather_parameters()
    for name, value in source.named_parameters():
        assert gathered[name].dtype == torch.float32 and torch.equal(gathered[name], value.detach().float()), name
    optimizer.close()


def test_shards_that_cannot_give_the_values_are_refused_naming_tensor_and_file(start_node, tmp_path):
    node = start_node(extra_args=("--admin", "127.0.0.1:0"))
    directory = _saved(tmp_path / "model", FAMILIES["llama"]())
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    # a shape that does not match the config
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(
        PretrainedWeightsError,
        match=r"model\.layers\.0\.mlp\.\w+_proj\.weight in .*model-\d+-of-\d+\.safetensors: shape \[\d+, \d+\], the config's model needs",
    ):
        offload_causal_lm(directory, nodes=[node.address], **OPTIONS)
    (directory / "config.json").write_text(json.dumps(config))
    # a tensor no shard holds
    name = "model.layers.1.self_attn.q_proj.weight"
    (directory / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": {k: v for k, v in index["weight_map"].items() if k != name}}))
    with pytest.raises(PretrainedWeightsError, match=rf"{name}: no shard of .* holds it"):
        offload_causal_lm(directory, nodes=[node.address], **OPTIONS)
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    # a shard that cannot be read
    shard = directory / index["weight_map"][name]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(PretrainedWeightsError, match=rf"{shard.name}: the shard cannot be read"):
        offload_causal_lm(directory, nodes=[node.address], **OPTIONS)
    with grpc.insecure_channel(node.admin_address) as channel:
        status = admin_pb2_grpc.OptimizerNodeAdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
    assert not status.registered and status.bytes_owned == 0, "refused before anything reached the node"


def test_the_example_fine_tunes_with_two_workers(start_node, tmp_path):
    """examples/finetune_hf.py as its docstring runs it: torchrun, two workers, one node; then the
    same command again goes on at the step the nodes are at."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    directory = _saved(tmp_path / "model", FAMILIES["llama"]())
    node = start_node()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    for steps in (3, 5):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "examples/finetune_hf.py"]
        command += ["--model", str(directory), "--nodes", node.address, "--steps", str(steps), "--global-batch", "4", "--seq-len", "16"]
        result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert f"step {steps - 1}: loss " in result.stdout
    assert "step 0:" not in result.stdout, "the second run went on at step 3, where the nodes were"
