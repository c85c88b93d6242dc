"""Hugging Face weights straight into an FSDP2 mesh (``ckpttool.load``: each rank reads its own
bytes) and back out as a folder ``from_pretrained`` reads: a tiny random Llama from transformers,
written by ``save_pretrained`` inside the test, compared bitwise with ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency (pyproject's test extra): these tests never skip

from ckpttool import convert

from ..helpers import assert_same_nested, cli
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


def test_tied_weights_the_file_holds_with_different_values_are_refused_naming_both(hf_dir, tmp_path):
    """A model that ties lm_head to the embedding, loaded from a file holding both with different
    values (trained untied): refused with one line naming both keys, on 2 FSDP2 ranks and in one
    process, never one of them dropped in silence. Equal values load."""
    import ckpttool
    from ckpttool.errors import MismatchError

    path, expected = hf_dir  # untied: lm_head.weight differs from model.embed_tokens.weight
    assert not torch.equal(expected["lm_head.weight"], expected["model.embed_tokens.weight"])
    untied = tmp_path / "untied.pt"
    torch.save(expected, untied)
    error = run_ranks(load_error, 2, str(untied), tie=True)[0]
    assert "MismatchError" in error and "'lm_head.weight'" in error and "'model.embed_tokens.weight'" in error, error
    assert "tie_word_embeddings=False" in error
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config(True))
    with pytest.raises(MismatchError, match="holds different values under 'lm_head.weight' and 'model.embed_tokens.weight'"):
        ckpttool.load(str(untied), model)
    same = tmp_path / "same.pt"  # both keys, one value (a tied model's full state dict)
    torch.save({**expected, "lm_head.weight": expected["model.embed_tokens.weight"]}, same)
    got = run_ranks(load_pretrained, 2, str(same), tie=True)[0]
    assert got["missing"] == [] and got["unexpected"] == []
    assert torch.equal(got["state"]["lm_head.weight"], expected["model.embed_tokens.weight"])
    assert torch.equal(got["state"]["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])


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
    # --like's files: the same shard names, each holding the same tensors, and the index
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(p.name for p in Path(path).glob("*.safetensors"))
    assert _weight_map(out) == _weight_map(path)


def _weight_map(folder) -> dict:
    return json.loads((Path(folder) / "model.safetensors.index.json").read_text())["weight_map"]


def test_an_export_follows_the_files_of_the_folder_it_is_like(hf_dir, tmp_path):
    """One ``model.safetensors`` (save_pretrained under its shard size), or one ``pytorch_model.bin``
    (transformers 4.x with safe_serialization=False): the export is one ``model.safetensors`` and
    no index; ``--max-shard-size`` splits it by size instead."""
    path, expected = hf_dir
    src = tmp_path / "step.pt"  # a step's layout: the model under "model"
    torch.save({"model": expected, "extra": {"step": 3}}, src)
    one = tmp_path / "one"
    _reference().save_pretrained(one)
    assert sorted(p.name for p in one.glob("model*")) == ["model.safetensors"]
    binary = tmp_path / "bin"
    _reference().config.save_pretrained(binary)
    torch.save(_reference().state_dict(), binary / "pytorch_model.bin")
    for like in (one, binary):
        out = tmp_path / f"out-{like.name}"
        convert(str(src), str(out), to="hf", like=str(like))
        assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"], like
        assert_same_nested(transformers.LlamaForCausalLM.from_pretrained(out).state_dict(), expected, f"like {like.name}")
    out = tmp_path / "by-size"
    convert(str(src), str(out), to="hf", like=str(one), max_shard_size="60KB")
    assert len(_weight_map(out)) == len(expected) and len(list(out.glob("model-*-of-*.safetensors"))) > 2
    assert_same_nested(transformers.LlamaForCausalLM.from_pretrained(out).state_dict(), expected, "by size")


def test_a_save_pretrained_folder_of_one_pytorch_model_bin_is_read_and_loaded(hf_dir, tmp_path):
    """What transformers 4.x's ``save_pretrained(safe_serialization=False)`` writes under its shard
    size (config.json and one ``torch.save`` of the state dict as pytorch_model.bin; transformers 5
    writes safetensors only, so the test writes it as 4.x does): read as the sharded .bin folders
    are, by every command and by ckpttool.load."""
    path, expected = hf_dir
    folder = tmp_path / "bin"
    transformers.LlamaForCausalLM.from_pretrained(path).config.save_pretrained(folder)
    torch.save(expected, folder / "pytorch_model.bin")
    report = json.loads(cli("inspect", folder, "--json"))
    assert report["format"] == "torch" and len(report["entries"]) == len(expected)
    assert any("config.json" in n for n in report["notes"])
    out = tmp_path / "model.safetensors"
    cli("convert", folder, out)
    assert "OK: " in cli("verify", folder, "--against", out)
    got = run_ranks(load_pretrained, 2, str(folder))
    assert got[0]["missing"] == [] and got[0]["unexpected"] == []
    assert_same_nested(got[0]["state"], expected, "from pytorch_model.bin")
