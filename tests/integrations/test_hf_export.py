"""Back to Hugging Face: a Llama trained on two nodes, exported from their checkpoints shard by shard
as a directory that AutoModelForCausalLM.from_pretrained loads with the trained values; what cannot
be exported as asked is refused before anything is written."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_worker import RemoteAdamW
from netoptim import console
from netoptim.integrations.hf_export import ExportError, export_hf
from optimizer_node.state.checkpoint import resolve

transformers = pytest.importorskip("transformers")

CONFIG = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small Llama saved as its source directory, trained 3 steps on two nodes that checkpointed
    step 3 at their stop; returns (source dir, checkpoint roots, the trained model)."""
    from netoptim.launch.processes import NodeProcess

    tmp = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    source = tmp / "source"
    model.save_pretrained(source)
    (source / "generation_config.json").write_text(json.dumps({"max_new_tokens": 8}))
    roots = [tmp / f"node{i}" for i in range(2)]
    nodes = [NodeProcess(tmp, name=f"node{i}", extra_args=("--checkpoint-dir", str(root))).start() for i, root in enumerate(roots)]
    try:
        opt = RemoteAdamW(model.named_parameters(), lr=0.01, nodes=[n.address for n in nodes], rank=0, world_size=1, bucket_numel=4096)
        for step in range(3):
            tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.close()
    finally:
        for node in nodes:
            assert node.stop() == 0  # SIGTERM checkpoints step 3
    return source, roots, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_export_loads_with_from_pretrained_and_holds_the_trained_values(trained, tmp_path, dtype):
    source, roots, model = trained
    name = str(dtype).removeprefix("torch.")
    out = tmp_path / "exported"
    shard = 40_000 if dtype == torch.float32 else 20_000  # bytes: several shards
    assert console.main(["export", "--hf", str(out), "--hf-config", str(source), "--dtype", name, "--max-shard-size", str(shard), *map(str, roots)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and index["metadata"]["netoptim_step"] == 3
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == name and (out / "generation_config.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=dtype)
    assert loaded.dtype == dtype
    trained_values = dict(model.named_parameters())
    for param_name, value in loaded.named_parameters():
        assert torch.equal(value, trained_values[param_name].detach().to(dtype)), param_name


def test_one_shard_is_model_safetensors(trained, tmp_path):
    source, roots, _ = trained
    written = export_hf([resolve(root) for root in roots], tmp_path / "one", config=source, dtype="float32")
    assert written["shards"] == 1 and written["step"] == 3
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_what_cannot_be_exported_is_refused_before_anything_is_written(trained, tmp_path):
    source, roots, _ = trained
    checkpoints = [resolve(root) for root in roots]
    other = tmp_path / "other"
    transformers.LlamaConfig(**{**CONFIG, "intermediate_size": 48}).save_pretrained(other)
    with pytest.raises(ExportError, match=r"shapes differ from the model of .*config\.json: model\.layers\.0\.mlp\.\w+_proj\.weight"):
        export_hf(checkpoints, tmp_path / "a", config=other)
    tied = tmp_path / "tied"
    transformers.LlamaConfig(**CONFIG, tie_word_embeddings=True).save_pretrained(tied)
    with pytest.raises(ExportError, match=r"the job's parameters \['lm_head\.weight'\] are not the model's"):
        export_hf(checkpoints, tmp_path / "b", config=tied)
    bigger = tmp_path / "bigger"
    transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 3}).save_pretrained(bigger)
    with pytest.raises(ExportError, match=r"the nodes hold no values of \['model\.layers\.2\..*from_pretrained would initialize them at random"):
        export_hf(checkpoints, tmp_path / "c", config=bigger)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ExportError, match="is not an empty directory"):
        export_hf(checkpoints, tmp_path / "full", config=source)
    with pytest.raises(ExportError, match="dtype 'int8'"):
        export_hf(checkpoints, tmp_path / "d", config=source, dtype="int8")
    assert not any((tmp_path / name).exists() for name in "abcd")
    assert console.main(["export", "--hf", str(tmp_path / "e"), *map(str, roots)]) == 2  # --hf without --hf-config
