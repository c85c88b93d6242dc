"""Rank functions for loading Hugging Face weights into FSDP2 (tests/dist/test_pretrained.py): a tiny
random Llama from transformers, built on the meta device, sharded bottom-up, loaded by ckpttool."""

from __future__ import annotations

from typing import Any


def tiny_config(tie: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)


def sharded_llama(tie: bool = False, mesh_shape: tuple[int, ...] | None = None, wrap: bool = False):
    """The model as a fine-tuner builds it: meta device, ``fully_shard`` per decoder layer then the
    root, storage allocated (uninitialised) on CPU."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    shape = mesh_shape or (dist.get_world_size(),)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None)
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_config(tie))
        top = torch.nn.Module() if wrap else model
        if wrap:
            top.llm = model
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(top, mesh=mesh)
    top.to_empty(device="cpu")
    return top


def full_state(model) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_pretrained(src: str, tie: bool = False, mesh_shape: tuple[int, ...] | None = None, wrap: bool = False,
                    key_map: dict[str, str] | None = None, strict: bool = True) -> dict[str, Any]:
    """Load ``src`` into a freshly sharded tiny Llama; its full state (rank 0) and what the load said."""
    import torch.distributed as dist

    import ckpttool

    model = sharded_llama(tie, mesh_shape, wrap)
    result = ckpttool.load(src, model, key_map=key_map, strict=strict)
    state = full_state(model)
    return {"state": state if dist.get_rank() == 0 else None, "missing": result.missing_keys,
            "unexpected": result.unexpected_keys}


def load_error(src: str, **kwargs: Any) -> str:
    """The typed error a load raises (its text), or ``no error``."""
    from ckpttool.errors import CkptError

    try:
        load_pretrained(src, **kwargs)
    except CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def train_save_export(src: str, root: str, tie: bool = False) -> dict[str, Any]:
    """Load ``src``, train two steps (AdamW), save with the Checkpointer; the trained full state."""
    import torch
    import torch.distributed as dist

    import ckpttool

    model = sharded_llama(tie)
    ckpttool.load(src, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        ids = torch.randint(0, 96, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    ck = ckpttool.Checkpointer(root)
    ck.save(2, model, opt)
    ck.close()
    state = full_state(model)
    return {"state": state if dist.get_rank() == 0 else None}
