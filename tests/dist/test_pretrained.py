"""Hugging Face weights straight into an FSDP2 mesh (``ckpttool.load``: each rank reads its own
bytes) and back out as a folder ``from_pretrained`` reads: a tiny random Llama from transformers,
written by ``save_pretrained`` inside the test, compared bitwise with ``from_pretrained``."""

from __future__ import annotations

import pytest
import torch
import transformers  # a test dependency (pyproject's test extra): these tests never skip

from ckpttool import convert

from ..helpers import assert_same_nested
from .harness import run_ranks
from .pretrained_workloads import load_error, load_pretrained, tiny_config, train_save_export


def _reference(tie: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_config(tie))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A sharded ``save_pretrained`` folder (several safetensors shards and the index) and the
    state ``from_pretrained`` reads from it."""
    out = tmp_path_factory.mktemp("hf") / "llama"
    _reference().save_pretrained(out, max_shard_size="60KB")
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 2
    return str(out), transformers.LlamaForCausalLM.from_pretrained(out).state_dict()


@pytest.mark.parametrize("world,mesh", [(2, None), (3, None), (4, (2, 2))])
def test_a_sharded_pretrained_folder_loads_bitwise_on_any_mesh(hf_dir, world, mesh):
    path, expected = hf_dir
    got = run_ranks(load_pretrained, world, path, mesh_shape=mesh)
    assert got[0]["missing"] == [] and got[0]["unexpected"] == []
    assert_same_nested(got[0]["state"], expected, f"{world} ranks, mesh {mesh}")


def test_a_torch_save_full_state_dict_loads_bitwise(hf_dir, tmp_path):
    path, expected = hf_dir
    pt = tmp_path / "full.pt"
    torch.save(transformers.LlamaForCausalLM.from_pretrained(path).state_dict(), pt)
    got = run_ranks(load_pretrained, 2, str(pt))
    assert_same_nested(got[0]["state"], expected, "from a .pt")


def test_a_wrapper_prefix_is_found_by_itself_and_a_key_map_renames(hf_dir, tmp_path):
    path, expected = hf_dir
    got = run_ranks(load_pretrained, 2, path, wrap=True)
    assert_same_nested(got[0]["state"], {f"llm.{k}": v for k, v in expected.items()}, "under llm.")
    renamed = tmp_path / "renamed.pt"  # another naming: decoder.* for model.*
    torch.save({k.replace("model.", "decoder.", 1): v for k, v in expected.items()}, renamed)
    got = run_ranks(load_pretrained, 2, str(renamed), key_map={r"^model\.": "decoder."})
    assert_same_nested(got[0]["state"], expected, "key_map")
    error = run_ranks(load_error, 2, str(renamed))[0]
    assert "MismatchError" in error and "not in the checkpoint" in error and "key_map" in error


def test_strict_false_loads_what_matches_and_returns_the_rest(hf_dir, tmp_path):
    path, expected = hf_dir
    partial = tmp_path / "partial.pt"
    kept = {k: v for k, v in expected.items() if "layers.1." not in k}
    torch.save({**kept, "extra.head.weight": torch.ones(3)}, partial)
    assert "MismatchError" in run_ranks(load_error, 2, str(partial))[0]
    got = run_ranks(load_pretrained, 2, str(partial), strict=False)
    assert sorted(got[0]["missing"]) == sorted(k for k in expected if "layers.1." in k)
    assert got[0]["unexpected"] == ["extra.head.weight"]
    assert_same_nested({k: got[0]["state"][k] for k in kept}, kept, "the keys that matched")


def test_tied_embeddings_absent_from_the_file_are_tied(tmp_path):
    out = tmp_path / "tied"
    _reference(tie=True).save_pretrained(out)
    expected = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    from ckpttool.formats import open_source

    with open_source(str(out)) as source:
        assert "lm_head.weight" not in source.index()  # the file holds the embedding once
    got = run_ranks(load_pretrained, 2, str(out), tie=True)
    assert got[0]["missing"] == []
    assert_same_nested(got[0]["state"], expected, "tied")


def test_trained_saved_and_exported_like_the_original_reads_back_with_from_pretrained(hf_dir, tmp_path):
    path, _ = hf_dir
    root = tmp_path / "run"
    trained = run_ranks(train_save_export, 2, path, str(root))[0]["state"]
    out = tmp_path / "export"
    convert(str(root / "step-2"), str(out), to="hf", like=path)
    assert (out / "config.json").exists()
    back = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    model, info = back
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_same_nested(model.state_dict(), trained, "exported")
